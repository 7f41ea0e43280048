"""What each C++ CPU kernel buys on SmolLM2-135M, switched on and off inside one engine.

    .venv/bin/python bench/bench_cpu_kernels.py [--quick] [--dtype float32|bfloat16]

Part 1, in the engine: section 16's random and shared loads run through one Engine several
times; a switch flips on every step (decode attention: the C++ kernel or the bucketed flash
path; the fused elementwise ops: C++ or torch), so neighbouring steps of nearly the same
batch time both sides, and a slow minute on this shared machine hits both alike. Medians of
the pure decode steps on each side.

Part 2, the fused ops alone: residual + RMSNorm, RoPE out of the qkv rows and silu * up at
SmolLM2's widths, C++ against the torch form, 48 and 2,048 rows, alternated, medians.

Results: bench/results/cpu_kernels[_bfloat16].json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from common import REPO, log, machine_info, time_ms, write_result

sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import cascade, fused_ops  # noqa: E402

from bench_vllm import KV_CACHE_BYTES, make_loads  # noqa: E402
from smollm2 import smollm2_dir  # noqa: E402


def switched_steps(engine, load: dict, switch: str, runs: int) -> dict:
    """Run `load` `runs` times with `switch` flipping every step; median pure-decode step (ms) per side."""
    from runtime import SamplingParams

    state = {"on": False}
    originals = (fused_ops.native_for, kernels.plan_decode)
    if switch == "fused_ops":
        fused_ops.native_for = lambda x: state["on"] and originals[0](x)
    else:  # decode attention: the C++ kernel's rows, or the bucketed flash path
        kernels.plan_decode = lambda *a, **k: cascade.plan_decode(*a, native=state["on"], **k)
    execute = engine.runner.execute
    times = {True: [], False: []}

    def timed(batch):
        state["on"] = not state["on"]
        start = time.perf_counter()
        out = execute(batch)
        if batch.num_decodes == sum(batch.num_new_tokens):
            times[state["on"]].append(time.perf_counter() - start)
        return out

    engine.runner.execute = timed
    try:
        for run in range(runs):
            prompts = [[3 + run] + p[1:] for p in load["prompts"]]  # a new first token: no hits across runs
            engine.generate(prompts, SamplingParams(max_tokens=load["max_tokens"], temperature=0, ignore_eos=True))
    finally:
        engine.runner.execute = execute
        fused_ops.native_for, kernels.plan_decode = originals
    on, off = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
    return {"on_ms": round(on, 2), "off_ms": round(off, 2), "speedup": round(off / on, 3), "steps": len(times[True])}


def fused_ops_alone(dtype: torch.dtype, repeats: int) -> dict:
    """C++ against torch for the three fused ops at SmolLM2's widths, alternated, medians (ms)."""
    rows_out = {}
    for rows in (48, 2048):
        gen = torch.Generator().manual_seed(rows)
        x, residual = (torch.randn(rows, 576, generator=gen).to(dtype) for _ in range(2))
        weight = torch.randn(576, generator=gen).to(dtype)
        qkv = torch.randn(rows, 960, generator=gen).to(dtype)
        positions = torch.randint(0, 2000, (rows,), generator=gen)
        cos, sin = torch.randn(8192, 64, generator=gen), torch.randn(8192, 64, generator=gen)
        gate_up = torch.randn(rows, 3072, generator=gen).to(dtype)
        ops = {
            "add_rms_norm": lambda native: fused_ops.add_rms_norm(x, residual.clone(), weight, 1e-5, native),
            "rope_qkv": lambda native: fused_ops.rope_qkv(qkv, positions, cos, sin, 9, 3, native),
            "silu_and_mul": lambda native: fused_ops.silu_and_mul(gate_up, native),
        }
        for name, op in ops.items():
            native, torch_ms = [], []
            for _ in range(repeats):
                native.append(time_ms(lambda: op(True), 20))
                torch_ms.append(time_ms(lambda: op(False), 20))
            rows_out[f"{name}@{rows}"] = {"cpp_ms": round(statistics.median(native), 3),
                                          "torch_ms": round(statistics.median(torch_ms), 3)}
            log(f"  {name} x {rows} rows: C++ {rows_out[f'{name}@{rows}']['cpp_ms']} ms, "
                f"torch {rows_out[f'{name}@{rows}']['torch_ms']} ms")
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    from runtime import Engine

    torch.set_num_threads(2)
    random.seed(0)
    model = smollm2_dir()
    engine = Engine.from_pretrained(model, max_num_seqs=128, max_num_batched_tokens=2048, enable_prefix_caching=True,
                                    dtype=args.dtype, kv_cache_memory_bytes=KV_CACHE_BYTES)
    loads = make_loads(args.quick, json.loads((model / "config.json").read_text())["vocab_size"])
    runs = 1 if args.quick else 2
    result = {"machine": machine_info(), "dtype": args.dtype, "model": "smollm2", "in_engine": {}}
    for switch in ("decode_attention", "fused_ops"):
        for name, load in loads.items():
            log(f"{switch}, {name} load: switched every step, {runs} run(s)")
            row = switched_steps(engine, load, switch, runs)
            log(f"  decode step on {row['on_ms']} ms, off {row['off_ms']} ms: x{row['speedup']}")
            result["in_engine"][f"{switch}@{name}"] = row
    log("fused ops alone")
    result["fused_ops"] = fused_ops_alone(getattr(torch, args.dtype), 1 if args.quick else 3)
    write_result("cpu_kernels" + ("" if args.dtype == "float32" else f"_{args.dtype}"), args.quick, result)


if __name__ == "__main__":
    main()
