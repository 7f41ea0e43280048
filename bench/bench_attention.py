"""Decode attention on the CPU: today's gather path, the per-sequence path, cascade, side by side.

    .venv/bin/python bench/bench_attention.py [--quick] [--repeats N] [--flex]

One decode step's attention for one layer (8 query / 2 KV heads, head_dim 64, 16-token pages,
float32; pages shuffled over a pool, so tables are not contiguous), three paths over the same
inputs, alternated, median of the repeats:
- gather:    kernels/reference.py: every row's pages copied into a padded [rows, max_ctx] K/V,
             then SDPA with a mask (the CPU path before this benchmark, and the oracle);
- per_seq:   kernels/cascade.py with no groups: each row's pages, query heads of a KV head as
             rows of torch's CPU flash kernel (no K/V repeat for GQA);
- one_bucket: cascade with every row's private pages padded to the longest row's (the plan
             before private buckets);
- cascade:   kernels/cascade.py with its plan: each shared prefix once per group, merged by
             log-sum-exp with each row's private pages, padded per bucket of similar rows.
Loads: the issue's goal shape (64 readers of one 1,024-token prefix, 64-token private
suffixes); the serving shape (96 rows, 4 prefixes x 384 + 32-80 private); no sharing
(64 rows, 64-256 tokens); a served random load, as `vllm bench serve --dataset-name random`
left it mid-run (80 rows: 8 groups of 2-16 over 4-23 shared pages, private parts of 2-15
pages, one row of 36). Outputs are checked against the reference before timing.
--flex also times torch's flex_attention (torch.compile, ~20 s) on the goal shape with K/V
already contiguous per row (its best case; it has no paged form here).
Results: bench/results/attention.json.
"""

from __future__ import annotations

import argparse
import random

import torch
from common import (
    alternated,
    log,
    machine_info,
    median,
    pin_threads,
    quick_mode,
    time_ms,
    write_result,
)

from kernels import cascade, cpu_attention, reference

HQ, HKV, D, BS = 8, 2, 64, 16


def make_load(groups: list[tuple[int, list[int]]], loners: list[int], seed: int):
    """(q, k_cache, v_cache, padded tables, lens, table lists): group members share prefix pages."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [n for _, members in groups for n in members] + loners
    num_blocks = sum(-(-n // BS) for n in lens) + 64
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for shared_len, members in groups:
        prefix = [free.pop() for _ in range(shared_len // BS)]
        tables += [prefix + [free.pop() for _ in range(-(-n // BS) - len(prefix))] for n in members]
    tables += [[free.pop() for _ in range(-(-n // BS))] for n in loners]
    k_cache = torch.randn(num_blocks, BS, HKV, D, generator=gen)
    v_cache = torch.randn(num_blocks, BS, HKV, D, generator=gen)
    q = torch.randn(len(lens), HQ, D, generator=gen)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return q, k_cache, v_cache, padded, torch.tensor(lens, dtype=torch.int32), tables


LOADS = {
    "goal_64x1024_shared": lambda: make_load([(1024, [1024 + 64] * 64)], [], 0),
    "serving_4x384_shared": lambda: make_load([(384, [384 + 32 + (7 * i) % 48 for i in range(24)])] * 4, [], 1),
    "no_sharing_64": lambda: make_load([], [64 + (37 * i) % 192 for i in range(64)], 2),
    "served_random_80": lambda: make_load(
        [(pages * BS, [pages * BS + 20 + (53 * (i + j)) % 210 for j in range(members)])
         for i, (pages, members) in enumerate([(23, 16), (14, 8), (7, 8), (4, 4), (5, 4), (4, 2), (5, 2), (8, 2)])],
        [30 + (41 * i) % 210 for i in range(33)] + [580], 4),
}


def flex_goal_ms(iters: int) -> float:
    """flex_attention on the goal shape, K/V contiguous per row, one block mask per row."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    rows, ctx = 64, 1024 + 64
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, HQ, rows, D, generator=gen)
    k = torch.randn(1, HKV, rows * ctx, D, generator=gen)
    v = torch.randn(1, HKV, rows * ctx, D, generator=gen)
    mask = create_block_mask(lambda b, h, qi, ki: ki // ctx == qi, 1, None, rows, rows * ctx, device="cpu",
                             BLOCK_SIZE=(16, 128))
    compiled = torch.compile(flex_attention)
    log("compiling flex_attention (~20 s)")
    return time_ms(lambda: compiled(q, k, v, block_mask=mask, enable_gqa=True), iters)


def measure_load(name: str, load, repeats: int, iters: int) -> dict:
    """The paths on one load (the C++ ones where they build), checked against the reference, then timed alternated."""
    q, k_cache, v_cache, padded, lens, tables = load
    scale = D**-0.5
    plan = cascade.plan_decode(tables, lens.tolist(), BS, native=False)  # private parts: flash buckets
    no_groups = cascade.plan_decode(tables, lens.tolist(), BS, min_shared_pages=10**9, native=False)
    one_bucket = cascade.plan_decode(tables, lens.tolist(), BS, bucket_call_pages=10**9, native=False)
    paths = {
        "gather": lambda: reference.paged_decode_attention(q, k_cache, v_cache, padded, lens, scale),
        "per_seq": lambda: cascade.cascade_decode_attention(q, k_cache, v_cache, no_groups, scale),
        "one_bucket": lambda: cascade.cascade_decode_attention(q, k_cache, v_cache, one_bucket, scale),
        "cascade": lambda: cascade.cascade_decode_attention(q, k_cache, v_cache, plan, scale),
    }
    if cpu_attention.available():  # the private parts in C++ (kernels/cpu_attention.py), what the CPU serves with
        cpp_plan = cascade.plan_decode(tables, lens.tolist(), BS, native=True)
        cpp_no_groups = cascade.plan_decode(tables, lens.tolist(), BS, min_shared_pages=10**9, native=True)
        paths["per_seq_cpp"] = lambda: cascade.cascade_decode_attention(q, k_cache, v_cache, cpp_no_groups, scale)
        paths["cascade_cpp"] = lambda: cascade.cascade_decode_attention(q, k_cache, v_cache, cpp_plan, scale)
    expected = paths["gather"]()
    for path, fn in paths.items():
        error = (fn() - expected).abs().max().item()
        if error > 1e-4:
            raise RuntimeError(f"{name}: {path} differs from the reference by {error}")
    times: dict[str, list[float]] = {path: [] for path in paths}
    for _, path in alternated(list(paths), repeats):
        times[path].append(time_ms(paths[path], iters))
    medians = {path: median(t) for path, t in times.items()}
    plan_ms = time_ms(lambda: cascade.plan_decode(tables, lens.tolist(), BS, native=False), iters)
    result = {
        "rows": len(tables), "groups": len(plan.groups), "shared_rows": plan.num_shared_rows,
        "private_buckets": len(plan.private),
        "median_ms": medians, "runs_ms": times, "plan_ms_per_step": plan_ms,
        "cascade_vs_per_seq": medians["per_seq"] / medians["cascade"],
        "cascade_vs_gather": medians["gather"] / medians["cascade"],
        "per_seq_vs_gather": medians["gather"] / medians["per_seq"],
        "cascade_vs_one_bucket": medians["one_bucket"] / medians["cascade"],
    }
    log(f"{name}: " + " ".join(f"{p} {m:.2f} ms" for p, m in medians.items())
        + f" | cascade x{result['cascade_vs_per_seq']:.1f} per_seq, "
          f"x{result['cascade_vs_gather']:.1f} gather, x{result['cascade_vs_one_bucket']:.1f} one bucket "
          f"({len(plan.private)} buckets); plan {plan_ms:.2f} ms/step")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--flex", action="store_true")
    args = parser.parse_args()
    quick_mode(args.quick)
    pin_threads()
    repeats = args.repeats or (2 if args.quick else 5)
    iters = 3 if args.quick else 10
    results = {name: measure_load(name, make(), repeats, iters) for name, make in LOADS.items()}
    if args.flex:
        results["goal_64x1024_shared"]["flex_attention_contiguous_ms"] = flex_goal_ms(iters)
        log(f"flex_attention (contiguous K/V): {results['goal_64x1024_shared']['flex_attention_contiguous_ms']:.2f} ms")
    path = write_result("attention", args.quick, {"machine": machine_info(), "repeats": repeats, "iters": iters,
                                                   "layout": {"num_q_heads": HQ, "num_kv_heads": HKV, "head_dim": D,
                                                              "block_size": BS, "dtype": "float32"},
                                                   "loads": results})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
