"""Q4_0/Q4_1 weights: our grouped kernel (kernels/grouped_matmul.py) against Int4Weight (torch's int4 CPU kernel).

    .venv/bin/python bench/bench_ggml_types.py [--quick] [--repeats N]

The same 4-bit blocks (Q4_1: value = q d + m per 32 inputs) in both forms: GroupedWeight
(the file's f16 scales as float16, float32 sums, the file's values exactly) and Int4Weight (torch's packed int4
layout, bfloat16 scales; on a CPU without AVX512-BF16 aten._weight_int4pack_mm_for_cpu below
64 rows, else its weight unpacked to bfloat16 and multiplied by F.linear). Shapes:

    smollm2   30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536; head 49152x576
    llama-1b  4 of Llama-3.2-1B's 16 layers: qkv 3072x2048, o 2048x2048, gate_up 16384x2048,
              down 2048x8192; head 128256x2048

per row count (1, 4, 16, 64, 256): ms for one pass over the layers, and for the head, each kernel
in turn (A B, B A, ...), median of the repeats. A kernel whose run passes SLOW_S is not run at
larger row counts (null). runtime/model/quantize.py's choice of form for Q4_0/Q4_1 reads this.
Results: bench/results/ggml_types.json (the CPU's model name and flags with them).
"""

from __future__ import annotations

import argparse
import time

import torch

from common import log, machine_info, median, write_result

from kernels import grouped_matmul
from runtime.model.ggml_blocks import IDENTITY4, Groups
from runtime.model.grouped import GroupedWeight
from runtime.model.quantized import Int4Weight

SHAPES = {"smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
          "llama-1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 4, (128256, 2048))}
ROWS = (1, 4, 16, 64, 256)
SLOW_S = 30.0


def _q4_1(out_features: int, in_features: int, gen: torch.Generator) -> tuple[GroupedWeight, Int4Weight]:
    """One random Q4_1 matrix in both forms (f16 scales and mins, as a file has them)."""
    groups = in_features // 32
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=gen)
    d = (torch.rand(out_features, groups, generator=gen) * 2e-3 + 1e-4).half().float()
    m = (-7.5 * d).half().float()
    return GroupedWeight(Groups(q, d, m, 32, IDENTITY4)), Int4Weight.from_q4(q, d, m)


def _cpu() -> dict:
    info = machine_info()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
        info["simd_flags"] = sorted(flag for flag in flags if flag.startswith(("avx", "fma", "amx", "f16c")))
    except (OSError, StopIteration):
        pass
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    rows_list = (1, 16) if args.quick else ROWS
    gen = torch.Generator().manual_seed(0)
    result = {"machine": _cpu(), "grouped_kernel_built": grouped_matmul.available(), "repeats": repeats,
              "unit": "ms per pass (median)", "shapes": {}}
    table = []
    with torch.inference_mode():
        for shape_name, (layer_shapes, num_layers, head_shape) in SHAPES.items():
            layers = [_q4_1(n, k, gen) for _ in range(num_layers) for n, k in layer_shapes]
            head = _q4_1(*head_shape, gen)
            parts = {"layers": layers, "head": [head]}
            result["shapes"][shape_name] = {"layers": num_layers, "layer_shapes": layer_shapes, "head": head_shape,
                                            "rows": {}}
            slow = set()
            for rows in rows_list:
                entry = result["shapes"][shape_name]["rows"][rows] = {}
                for part, weights in parts.items():
                    inputs = {k: torch.randn(rows, k, generator=gen) for k in {w[0].in_features for w in weights}}
                    times = {"grouped": [], "int4": []}
                    for r in range(repeats):
                        for index in (0, 1) if r % 2 == 0 else (1, 0):
                            name = ("grouped", "int4")[index]
                            if (part, name) in slow:
                                continue
                            if r == 0:  # warm-up
                                for w in weights:
                                    w[index].linear(inputs[w[index].in_features])
                            start = time.perf_counter()
                            for w in weights:
                                w[index].linear(inputs[w[index].in_features])
                            times[name].append((time.perf_counter() - start) * 1e3)
                            if times[name][-1] > SLOW_S * 1e3:
                                slow.add((part, name))
                    entry[part] = {name: (round(median(t), 2) if t else None) for name, t in times.items()}
                    table.append((shape_name, part, rows, entry[part]["grouped"], entry[part]["int4"]))
                    log(f"{shape_name} {part} rows={rows}: {entry[part]}")
            del layers, head, parts
    print(f"\n{'shape':9} {'part':6} {'rows':>5} {'grouped ms':>11} {'int4 ms':>9} {'int4/grouped':>12}")
    for shape_name, part, rows, grouped, int4 in table:
        ratio = f"{int4 / grouped:.2f}" if grouped and int4 else "-"
        print(f"{shape_name:9} {part:6} {rows:>5} {grouped if grouped is not None else '-':>11} "
              f"{int4 if int4 is not None else '-':>9} {ratio:>12}")
    write_result("ggml_types", args.quick, result)


if __name__ == "__main__":
    main()
