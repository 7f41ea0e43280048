"""The grouped kernel against another checkout's, call for call in one process: what a kernel change buys.

    .venv/bin/python bench/bench_kernel_ab.py --base /path/to/other/checkout [--types Q4_K Q6_K ...] [--rows 1 16 64]

On a machine whose speed drifts by 20-50% over minutes (a shared VM), runs of two versions one after
another compare the machine, not the code. Here both kernels (kernels/csrc/grouped_matmul.cpp of this
checkout, and of `--base`, e.g. a `git worktree` of the previous commit) are built and loaded into one
process, and each measurement alternates them: for each GGUF type (random valid blocks, as
bench_grouped_rows.py makes them), Llama-3.2-1B's gate_up and down shapes, in copies that together exceed
the last-level cache, and each row count, PASSES rounds of (this kernel over all copies, the base's over
all copies); a kernel's time is its best round. The base is given the same weights, with any float16
units of factored scales widened to float32 (the same values; a base from before they existed takes
only float32). Results: bench/results/kernel_ab.json, with this machine's CPU.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common import log, machine_info, pin_threads, quick_mode, write_result  # puts the repository on sys.path

from bench_grouped_rows import SHAPES, TYPES, weight_copies  # noqa: E402

from kernels import cpu_extension, grouped_matmul  # noqa: E402

PASSES = 5


def base_kernel(base: Path):
    """The other checkout's grouped_matmul module, built from its own sources (an extra define keeps its build apart)."""
    csrc = base / "kernels" / "csrc"
    if not (csrc / "grouped_matmul.cpp").is_file():
        raise SystemExit(f"{base} has no kernels/csrc/grouped_matmul.cpp")
    ours = cpu_extension.CSRC
    cpu_extension.CSRC = csrc
    try:
        module = cpu_extension.load("grouped_matmul.cpp", ("-DPAGEDSERVE_AB_BASE",))
    finally:
        cpu_extension.CSRC = ours
    if module is None:
        raise SystemExit(f"the kernel of {base} did not build")
    return module


def _widened(arguments: tuple) -> tuple:
    """Kernel arguments with float16 units (of factored scales or zeros) as float32: the same values."""
    return tuple(a.float() if i in (2, 4) and a.dtype == torch.float16 else a for i, a in enumerate(arguments))


def _round(run, argument_sets: list[tuple], x: torch.Tensor) -> float:
    start = time.perf_counter()
    for arguments in argument_sets:
        run(x, *arguments)
    return (time.perf_counter() - start) / len(argument_sets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    quick_mode(args.quick)
    pin_threads()
    ours, theirs = grouped_matmul._extension().grouped_matmul, base_kernel(args.base.resolve()).grouped_matmul
    results = []
    for type_name, n, k, copies in weight_copies(args.types, args.quick):
        our_sets = [w.kernel_arguments() for w in copies]
        their_sets = [_widened(a) for a in our_sets]
        for rows in args.rows:
            x = torch.randn(rows, k)
            ours(x, *our_sets[0]), theirs(x, *their_sets[0])  # built and warm
            times = {"ours": [], "base": []}
            for _ in range(PASSES):
                times["ours"].append(_round(ours, our_sets, x))
                times["base"].append(_round(theirs, their_sets, x))
            best = {name: min(values) * 1e3 for name, values in times.items()}
            results.append({"type": type_name, "form": copies[0].form, "out": n, "in": k, "rows": rows,
                            "ms_ours": best["ours"], "ms_base": best["base"], "base_over_ours": best["base"] / best["ours"]})
            log(f"{type_name} {n}x{k} rows {rows:3d}: ours {best['ours']:.3f} ms, base {best['base']:.3f} ms "
                f"(x{best['base'] / best['ours']:.2f})")
    write_result("kernel_ab", args.quick, {"machine": machine_info(), "base": str(args.base), "passes": PASSES,
                                           "rows": results})
    print(f"{'type':6s} {'shape':10s} " + " ".join(f"{r:>16d}" for r in args.rows) + "   (ms a call: base / ours)")
    for type_name in args.types:
        for n, k in SHAPES:
            cells = [next(r for r in results if (r["type"], r["out"], r["in"], r["rows"]) == (type_name, n, k, rows))
                     for rows in args.rows]
            print(f"{type_name:6s} {f'{n}x{k}':10s} " + " ".join(f"{c['ms_base']:7.3f}/{c['ms_ours']:7.3f}" for c in cells))


if __name__ == "__main__":
    main()
