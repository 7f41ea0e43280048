"""The model's matmuls on the CPU: F.linear (MKL) against oneDNN with the weight packed once.

    .venv/bin/python bench/bench_linear.py [--quick] [--repeats N]

The shapes of the 23M Llama's layers (hidden 512, 8 query / 2 KV heads, intermediate 1408:
qkv 768x512, o 512x512, gate_up 2816x512, down 512x1408) at 1-2,048 tokens, float32 and
bfloat16, the two alternated, median of the repeats. runtime/model/linear.py uses the
packed path on the CPU. Results: bench/results/linear_onednn.json.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from common import (
    alternated,
    log,
    machine_info,
    median,
    pin_threads,
    quick_mode,
    write_result,
)

from runtime.model import linear

SHAPES = {"qkv": (768, 512), "o": (512, 512), "gate_up": (2816, 512), "down": (512, 1408)}
TOKENS = (1, 16, 64, 128, 512, 2048)


def gflops(fn, flop: float, min_s: float) -> float:
    fn()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s:
        fn()
        count += 1
    return flop * count / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    quick_mode(args.quick)
    pin_threads()
    if not linear.onednn_available():
        raise SystemExit("this torch build has no oneDNN linear")
    repeats = args.repeats or (1 if args.quick else 3)
    min_s = 0.05 if args.quick else 0.2
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (out_features, in_features) in SHAPES.items():
            for tokens in TOKENS:
                x = torch.randn(tokens, in_features).to(dtype)
                weight = torch.randn(out_features, in_features).to(dtype)
                packed = linear.pack(weight)
                flop = 2 * tokens * out_features * in_features
                paths = {"F.linear": lambda x=x, w=weight: F.linear(x, w),
                         "onednn_packed": lambda x=x, w=weight, p=packed: linear.linear(x, w, None, p)}
                runs: dict[str, list[float]] = {p: [] for p in paths}
                for _, path in alternated(list(paths), repeats):
                    runs[path].append(gflops(paths[path], flop, min_s))
                row = {"dtype": str(dtype).removeprefix("torch."), "layer": name, "tokens": tokens,
                       **{f"{p}_gflops": round(median(v), 1) for p, v in runs.items()}}
                row["speedup"] = round(row["onednn_packed_gflops"] / row["F.linear_gflops"], 2)
                rows.append(row)
            log(f"{dtype} {name}: " + " ".join(f"{r['tokens']}:x{r['speedup']}" for r in rows[-len(TOKENS):]))
    path = write_result("linear_onednn", args.quick, {"machine": machine_info(), "repeats": repeats, "rows": rows})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
