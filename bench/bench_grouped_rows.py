"""What one more row costs the grouped kernel (kernels/grouped_matmul.py), per GGUF type: the batch's price.

    .venv/bin/python bench/bench_grouped_rows.py [--types Q4_0 Q4_K ...] [--rows 1 4 8 16 64] [--quick]

A decode step of 16 streams, and a prompt's prefill, run every weight against many rows at once;
past ~8 rows the kernel is bound by its arithmetic per row (integer dot products and one float
step per group), not by the weights' bytes. For each type, the shapes of Llama-3.2-1B's gate_up
(8192x2048) and down (2048x8192) as GroupedWeights of random valid blocks, in copies that
together exceed the last-level cache (cold weights, as in a step), one `linear` per copy, per row
count: ms a call and ms a row (the best of 3 passes; 2 threads). A type kept in 6 bits (Q5_x, Q6_K:
grouped6) is also run as the same codes in 8 bits (its form before), alternated call for call with
it. Results: bench/results/grouped_rows.json, with this machine's CPU.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch

from common import log, machine_info, pin_threads, quick_mode, write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.gguf_files import encoded_blocks  # noqa: E402  (valid random blocks of any type)

from kernels import grouped_matmul  # noqa: E402
from runtime.model import ggml_blocks  # noqa: E402
from runtime.model.grouped import GroupedWeight  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0")
SHAPES = ((8192, 2048), (2048, 8192))  # Llama-3.2-1B's gate_up and down, [out, in]
COPIES_BYTES = 256 << 20  # weights held in copies: cold, as a step finds them


def _copies(type_name: str, n: int, k: int, budget: int, rng) -> list[GroupedWeight]:
    qtype = int(ggml_blocks.GGMLQuantizationType[type_name])
    first = GroupedWeight.from_groups([ggml_blocks.unpack_groups(encoded_blocks(type_name, n, k, rng), qtype, n, k)])
    count = max(2, budget // first.nbytes())
    return [first] + [GroupedWeight.from_groups([ggml_blocks.unpack_groups(encoded_blocks(type_name, n, k, rng), qtype,
                                                                           n, k)]) for _ in range(count - 1)]


def eight_bit_twin(weight: GroupedWeight) -> GroupedWeight:
    """A grouped6 weight's codes as 8-bit panels (the form Q5_x and Q6_K took before): the same values."""
    twin = copy.copy(weight)
    twin.codes = grouped_matmul.to_panels(*grouped_matmul.to_rows(weight.codes, weight.scale, weight.zero))[0]
    twin.form, twin._kernel = "grouped8", None
    return twin


def weight_copies(types: list[str], quick: bool):
    """(type, out, in, copies) for each type and shape of SHAPES: random valid blocks in copies that together
    exceed the last-level cache (an eighth of that under --quick), the same blocks on every run."""
    rng = np.random.default_rng(0)
    budget = COPIES_BYTES // (8 if quick else 1)
    for type_name in types:
        for n, k in SHAPES:
            yield type_name, n, k, _copies(type_name, n, k, budget, rng)


def measure(copies: list[GroupedWeight], rows: int, passes: int = 3) -> float:
    """Seconds of one call at `rows` rows: the best pass over all the copies."""
    x = torch.randn(rows, copies[0].in_features)
    copies[0].linear(x)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for weight in copies:
            weight.linear(x)
        best = min(best, (time.perf_counter() - start) / len(copies))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16, 64])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    quick_mode(args.quick)
    pin_threads()
    results = []
    for type_name, n, k, copies in weight_copies(args.types, args.quick):
        forms = [copies] + ([[eight_bit_twin(w) for w in copies]] if copies[0].form == "grouped6" else [])
        for rows in args.rows:
            for _ in range(3 if len(forms) > 1 else 1):  # alternated, each pass the best of 3
                for weights in forms:
                    seconds = measure(weights, rows)
                    results.append({"type": type_name, "form": weights[0].form, "out": n, "in": k, "rows": rows,
                                    "ms": seconds * 1e3, "ms_per_row": seconds * 1e3 / rows,
                                    "weight_gbs": weights[0].nbytes() / seconds / 1e9})
                    log(f"{type_name} {weights[0].form} {n}x{k} rows {rows:3d}: {seconds * 1e3:7.3f} ms, "
                        f"{seconds * 1e3 / rows:.3f} ms a row")
    write_result("grouped_rows", args.quick, {"machine": machine_info(), "rows": results})
    print(f"{'type':6s} {'form':9s} {'shape':10s} " + " ".join(f"{r:>9d}" for r in args.rows) + "   (ms a row, best)")
    for type_name in args.types:
        for form in dict.fromkeys(r["form"] for r in results if r["type"] == type_name):
            for n, k in SHAPES:
                mine = [r for r in results if (r["type"], r["form"], r["out"], r["in"]) == (type_name, form, n, k)]
                cells = [min(r["ms_per_row"] for r in mine if r["rows"] == rows) for rows in args.rows]
                print(f"{type_name:6s} {form:9s} {f'{n}x{k}':10s} " + " ".join(f"{c:9.3f}" for c in cells))


if __name__ == "__main__":
    main()
