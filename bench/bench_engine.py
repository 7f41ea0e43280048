"""Engine throughput and latency against Hugging Face transformers; page waste on a mixed batch.

    .venv/bin/python bench/bench_engine.py [--repeats 3] [--quick]

Same model, same prompts, same per-request output lengths, greedy, EOS ignored, torch
threads pinned, one process, the three systems alternated, median of the repeats
(after one untimed warm-up run of each system). Results: bench/results/engine_vs_hf.json.

1. Page waste (no peer): a mixed-length batch through the engine on stories260K; at every
   step, slots in pages that hold no K/V, as a share of the slots in pages in use.
2. Offline throughput and per-request latency on stories260K and on a ~20M-parameter
   random-weight Llama. Each request has its own output length (log-uniform in
   [OUT_MIN, OUT_MAX]), so a static batch keeps computing rows that are done:
     pagedserve        Engine.add_request per prompt (max_tokens = its length), step() to the end
     hf-generate       model.generate, one static batch of all prompts, left padding,
                       max_new_tokens = min_new_tokens = the longest length (rows past their own
                       length are wasted work; only each request's own tokens are counted)
     hf-continuous     transformers' continuous batching (paged attention), an explicit
                       ContinuousBatchingConfig(page_size=16, num_blocks, max_batch_tokens) with
                       the same KV token budget and per-step token budget as pagedserve, one
                       add_request per prompt with its own max_new_tokens. (`generate_batch` is a
                       loop over this same manager but takes one max_new_tokens for all prompts.)
   Output tokens/s = requested output tokens / wall time from submission to the last result.
   Latency of a request = submission (all at t=0) to its result (static: its batch's end).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import statistics
import time
from pathlib import Path

from common import (STORIES, log, machine_info, make_prompts, median, num_parameters, percentile, pin_threads,
                    quick_mode, random_llama_dir, run_alternated, write_result)

import torch  # noqa: E402

from runtime import Engine, SamplingParams  # noqa: E402

PROMPT_MIN, PROMPT_MAX = 16, 128
OUT_MIN, OUT_MAX = 8, 256
KV_TOKENS = 16384  # KV token slots for both paged systems
MAX_BATCHED_TOKENS = 1024  # per-step token budget for both paged systems
BLOCK_SIZE = 16


def make_workload(num: int, seed: int, out_max: int = OUT_MAX) -> tuple[list[list[int]], list[int]]:
    prompts = make_prompts(num, PROMPT_MIN, PROMPT_MAX, seed=seed)
    rng = random.Random(seed + 1)
    lengths = [round(math.exp(rng.uniform(math.log(OUT_MIN), math.log(out_max)))) for _ in prompts]
    return prompts, lengths


# --- page waste -------------------------------------------------------------------------


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
            contiguous = sum(live.values())  # reserving prompt + max_tokens for the same live requests
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


# --- the three systems ------------------------------------------------------------------


def run_ours(model_dir: Path, prompts, lengths) -> dict:
    engine = Engine.from_pretrained(model_dir, num_blocks=KV_TOKENS // BLOCK_SIZE, block_size=BLOCK_SIZE,
                                    max_num_seqs=len(prompts), max_num_batched_tokens=MAX_BATCHED_TOKENS,
                                    enable_prefix_caching=False)
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    latency: dict[str, float] = {}
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                latency[out.request_id] = time.perf_counter() - start
                produced += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    if produced != sum(lengths):
        raise RuntimeError(f"pagedserve produced {produced} tokens, expected {sum(lengths)}")
    return _summary(elapsed, sum(lengths), list(latency.values()))


def run_hf_generate(model, prompts, lengths) -> dict:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    longest = max(lengths)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=longest,
                             min_new_tokens=longest, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    if out.shape[1] - width != longest:
        raise RuntimeError("transformers generate produced the wrong number of tokens")
    return _summary(elapsed, sum(lengths), [elapsed] * len(prompts))


def run_hf_continuous(model, prompts, lengths) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(lengths))
    cb_config = ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=KV_TOKENS // BLOCK_SIZE,
                                         max_batch_tokens=MAX_BATCHED_TOKENS, seed=0)
    with model.continuous_batching_context_manager(generation_config=generation_config,
                                                   continuous_batching_config=cb_config, block=True,
                                                   timeout=10) as manager:
        start = time.perf_counter()  # the manager (cache, warm-up) is built before the clock starts
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            manager.add_request(prompt, request_id=f"b{i}", max_new_tokens=n, eos_token_id=-1)
        latency: dict[str, float] = {}
        produced = 0
        while len(latency) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped early")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers continuous batching failed: {result.error}")
                latency[result.request_id] = time.perf_counter() - start
                produced += len(result.generated_tokens)
        elapsed = time.perf_counter() - start
    if produced != sum(lengths):
        raise RuntimeError(f"transformers continuous batching produced {produced} tokens, expected {sum(lengths)}")
    return _summary(elapsed, sum(lengths), list(latency.values()))


def _summary(elapsed: float, tokens: int, latencies: list[float]) -> dict:
    return {"output_tok_per_s": tokens / elapsed, "seconds": elapsed,
            "latency_p50_s": percentile(latencies, 0.5), "latency_p90_s": percentile(latencies, 0.9),
            "latency_mean_s": statistics.fmean(latencies)}


def throughput(name: str, model_dir: Path, num_prompts: int, repeats: int, out_max: int) -> dict:
    from transformers import AutoModelForCausalLM

    prompts, lengths = make_workload(num_prompts, seed=3, out_max=out_max)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    systems = {
        "pagedserve": lambda: run_ours(model_dir, prompts, lengths),
        "hf-generate": lambda: run_hf_generate(hf_model, prompts, lengths),
        "hf-continuous": lambda: run_hf_continuous(hf_model, prompts, lengths),
    }
    warm_prompts, warm_lengths = make_workload(4, seed=99, out_max=16)
    for system, _ in systems.items():  # untimed warm-up: first-call costs stay out of the medians
        log(f"throughput {name}: warm-up {system}")
        {"pagedserve": lambda: run_ours(model_dir, warm_prompts, warm_lengths),
         "hf-generate": lambda: run_hf_generate(hf_model, warm_prompts, warm_lengths),
         "hf-continuous": lambda: run_hf_continuous(hf_model, warm_prompts, warm_lengths)}[system]()
    runs = run_alternated(systems, repeats, f"throughput {name}")
    out = {
        "model": name,
        "parameters": num_parameters(model_dir),
        "num_prompts": len(prompts),
        "prompt_len_range": [min(map(len, prompts)), max(map(len, prompts))],
        "output_len_range": [min(lengths), max(lengths)],
        "output_tokens": sum(lengths),
        "systems": {},
    }
    for system, system_runs in runs.items():
        out["systems"][system] = {
            "output_tok_per_s": round(median([r["output_tok_per_s"] for r in system_runs]), 1),
            "latency_p50_s": round(median([r["latency_p50_s"] for r in system_runs]), 3),
            "latency_p90_s": round(median([r["latency_p90_s"] for r in system_runs]), 3),
            "latency_mean_s": round(median([r["latency_mean_s"] for r in system_runs]), 3),
            "seconds": [round(r["seconds"], 3) for r in system_runs],
            "background_cpu_pct": [r["background_cpu_pct"] for r in system_runs],
        }
    ours = out["systems"]["pagedserve"]
    for peer in ("hf-generate", "hf-continuous"):
        theirs = out["systems"][peer]
        out[f"throughput_ratio_vs_{peer}"] = round(ours["output_tok_per_s"] / theirs["output_tok_per_s"], 2)
        out[f"latency_p50_ratio_vs_{peer}"] = round(ours["latency_p50_s"] / theirs["latency_p50_s"], 2)
    log(f"throughput {name}: " + ", ".join(f"{k}={v}" for k, v in out.items() if "ratio" in k))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens, for a smoke run")
    args = parser.parse_args()
    quick_mode(args.quick)
    pin_threads()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    result = {"machine": machine_info(), "repeats": args.repeats,
              "kv_tokens": KV_TOKENS, "block_size": BLOCK_SIZE, "max_batched_tokens": MAX_BATCHED_TOKENS}
    log("page waste on a mixed-length batch ...")
    result["page_waste"] = [page_waste(STORIES, bs) for bs in ((16,) if args.quick else (8, 16, 32))]
    num_prompts, out_max = (8, 32) if args.quick else (32, OUT_MAX)
    result["throughput"] = [throughput("stories260K", STORIES, num_prompts, args.repeats, out_max)]
    llama20m, tmp = random_llama_dir()
    with tmp:
        result["throughput"].append(throughput("random-llama-20M", llama20m, num_prompts, args.repeats, out_max))
    write_result("engine_vs_hf", args.quick, result)


if __name__ == "__main__":
    main()
