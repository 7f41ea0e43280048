"""Engine throughput against Hugging Face transformers, and page waste on a mixed batch.

    .venv/bin/python bench/bench_engine.py [--repeats 3] [--quick]

Same prompts, same greedy decoding, same thread count, one process, systems alternated,
median of the repeats. Results: bench/results/engine_vs_hf.json.

1. Page waste: a mixed-length batch through the engine; at every step, slots in pages
   that hold no K/V, as a share of slots in pages in use (peak and time-averaged), next to
   what a contiguous max-length reservation would hold.
2. Output tokens/s of Engine.generate vs transformers `generate` (static batch, left
   padding, KV cache) on stories260K and on a ~20M-parameter random-weight Llama.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402

STORIES = REPO.parent / "shared" / "models" / "stories260K"
RESULTS = REPO / "bench" / "results"


def make_prompts(num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(min_len, max_len) - 1)] for _ in range(num)]


def make_random_llama(path: Path) -> Path:
    """A ~20M-parameter Llama with random weights and stories260K's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1408, num_hidden_layers=7, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES / name, path / name)
    return path


def page_waste(model_dir: Path, block_size: int) -> dict:
    """Run a mixed-length batch; sample the page bookkeeping after every step."""
    rng = random.Random(1)
    prompts = make_prompts(48, 4, 200, seed=2)
    max_tokens = [rng.randint(8, 200) for _ in prompts]
    engine = Engine.from_pretrained(model_dir, block_size=block_size, num_blocks=4096, max_num_batched_tokens=512)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"w{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    live: dict[str, int] = {f"w{i}": len(p) + n for i, (p, n) in enumerate(zip(prompts, max_tokens))}
    samples = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                live.pop(out.request_id)
        stats = engine.stats()
        reserved = stats["num_used_blocks"] * block_size
        if reserved:
            contiguous = sum(live.values())  # max-length reservation of the same live requests
            samples.append((reserved, stats["num_kv_tokens"], contiguous, stats["num_running"]))
    waste = [(r - used) / r for r, used, _, _ in samples]
    contiguous_waste = [(c - used) / c for _, used, c, _ in samples if c]
    waste_slots_per_seq = [(r - used) / n for r, used, _, n in samples if n]
    return {
        "block_size": block_size,
        "num_requests": len(prompts),
        "steps": len(samples),
        "peak_waste_pct": round(100 * max(waste), 2),
        "mean_waste_pct": round(100 * statistics.fmean(waste), 2),
        "max_empty_slots_per_running_seq": round(max(waste_slots_per_seq), 2),  # < block_size: under one page
        "reserve_prompt_plus_max_tokens_mean_waste_pct": round(100 * statistics.fmean(contiguous_waste), 2),
    }


def run_ours(model_dir: Path, prompts, max_new_tokens: int) -> float:
    engine = Engine.from_pretrained(model_dir, num_blocks=2048, max_num_seqs=len(prompts), max_num_batched_tokens=4096,
                                    enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if sum(len(o.outputs[0].token_ids) for o in outs) != len(prompts) * max_new_tokens:
        raise RuntimeError("engine produced the wrong number of tokens")
    return elapsed


def run_hf(model, prompts, max_new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    if out.shape[1] - width != max_new_tokens:
        raise RuntimeError("transformers produced the wrong number of tokens")
    return elapsed


def throughput(name: str, model_dir: Path, prompts, max_new_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ours, hf = [], []
    for _ in tqdm(range(repeats), desc=f"throughput {name}", unit="round"):
        ours.append(run_ours(model_dir, prompts, max_new_tokens))
        hf.append(run_hf(hf_model, prompts, max_new_tokens))
    tokens = len(prompts) * max_new_tokens
    ours_tps, hf_tps = tokens / statistics.median(ours), tokens / statistics.median(hf)
    return {
        "model": name,
        "num_prompts": len(prompts),
        "prompt_len_range": [min(map(len, prompts)), max(map(len, prompts))],
        "max_new_tokens": max_new_tokens,
        "pagedserve_tok_per_s": round(ours_tps, 1),
        "transformers_generate_tok_per_s": round(hf_tps, 1),
        "ratio": round(ours_tps / hf_tps, 2),
        "pagedserve_seconds": [round(t, 3) for t in ours],
        "transformers_seconds": [round(t, 3) for t in hf],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer prompts, for a smoke run")
    args = parser.parse_args()
    torch.manual_seed(0)
    num_prompts, max_new = (8, 16) if args.quick else (32, 64)
    result = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                          "torch": torch.__version__}}
    print("page waste on a mixed-length batch ...", file=sys.stderr)
    result["page_waste"] = [page_waste(STORIES, bs) for bs in (8, 16, 32)]
    prompts = make_prompts(num_prompts, 16, 128, seed=3)
    result["throughput"] = [throughput("stories260K", STORIES, prompts, max_new, args.repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        llama20m = make_random_llama(Path(tmp) / "llama-20m")
        result["throughput"].append(throughput("random-llama-20M", llama20m, prompts, max_new, args.repeats))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_path = RESULTS / ("engine_vs_hf_quick.json" if args.quick else "engine_vs_hf.json")
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
