"""Where a batch of requests' time goes in process: the prompts' prefill against the decode steps after it.

    .venv/bin/python bench/profile_phases.py [--files NAME...] [--batch 16] [--prompt 96] [--out 64] [--rounds 2]

For each GGUF file (bench/gguf_files.py names; default the random-weight Llama-3.2-1B shape in Q4_K_M) an
engine is built in this process as `pagedserve serve` builds it (quantization auto, float32 activations,
1 GiB of KV pages). Each round runs `--batch` prompts of `--prompt` random token ids twice through
Engine.generate: once to one token out (the prefill, and one step), then to `--out` tokens (the same
prefill, then the decode steps). Prefill tok/s is batch x prompt over the first; a decode step is the
difference over out - 1 steps. This is bench_gguf_speed.py's 16-stream load without the server, split in
its two phases. Results: bench/results/profile_phases.json, with this machine's CPU.
"""

from __future__ import annotations

import argparse
import random
import time

from common import log, machine_info, write_result
from gguf_files import gguf_path

from runtime import Engine, SamplingParams  # noqa: E402

VOCAB_FLOOR, VOCAB_CEILING = 1000, 32000  # ordinary tokens in every vocabulary here
KV_CACHE_BYTES = 1 << 30


def one_round(engine: Engine, rng: random.Random, batch: int, prompt: int, out: int) -> dict:
    """Seconds of a batch's prefill (one token out) and of its decode steps (out tokens, less the prefill)."""
    prompts = lambda: [[rng.randrange(VOCAB_FLOOR, VOCAB_CEILING) for _ in range(prompt)] for _ in range(batch)]  # noqa: E731
    started = time.perf_counter()
    engine.generate(prompts(), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    engine.generate(prompts(), SamplingParams(max_tokens=out, temperature=0, ignore_eos=True))
    whole = time.perf_counter() - started
    decode = max(whole - prefill, 0.0)
    return {"prefill_s": prefill, "prefill_tok_s": batch * prompt / prefill, "whole_s": whole,
            "decode_s": decode, "decode_step_ms": 1000 * decode / (out - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=["llama3.2-1b-Q4_K_M"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--out", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    result = {"machine": machine_info(), "batch": args.batch, "prompt": args.prompt, "out": args.out, "files": {}}
    for name in args.files:
        engine = Engine.from_pretrained(gguf_path(name), kv_cache_memory_bytes=KV_CACHE_BYTES,
                                        max_num_seqs=max(32, args.batch))
        rng = random.Random(0)
        engine.generate([[rng.randrange(VOCAB_FLOOR, VOCAB_CEILING) for _ in range(16)]] * 2,
                        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # kernels' first calls
        rounds = []
        for index in range(args.rounds):
            rounds.append(one_round(engine, rng, args.batch, args.prompt, args.out))
            row = rounds[-1]
            log(f"{name} round {index + 1}/{args.rounds}: prefill {row['prefill_s']:.2f} s ({row['prefill_tok_s']:.0f} tok/s), "
                f"decode {row['decode_s']:.2f} s ({row['decode_step_ms']:.0f} ms a {args.batch}-row step)")
        result["files"][name] = rounds
        del engine
    write_result("profile_phases", False, result)


if __name__ == "__main__":
    main()
