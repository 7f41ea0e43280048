"""Where the quantized matmul should switch paths: torch's int4/int8 kernels, ours in AVX512-BF16, unpack + oneDNN.

    .venv/bin/python bench/bench_quantized_linear.py [--quick]

SmolLM2-135M's shapes: one 30-layer pass of its four matmuls (qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536; 106M weights, 66 MB at 4 bits, so a pass reads from memory, not cache)
and its LM head (49,152x576, int8), for 1-512 rows, each path in turn, alternated, median of 5.
Also the dense float32 and bfloat16 oneDNN matmuls on the same shapes, for reference. The
crossovers set runtime/model/quantized.INT4_MANY_ROWS, INT8_BF16_DOT_MAX_ROWS and DENSE_MIN_ROWS. Our AVX512-BF16
kernels (kernels/quant_matmul.py) are timed where the CPU has AVX512-BF16.
Results: bench/results/quantized_linear.json.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from common import log, machine_info, median, write_result

from kernels import quant_matmul, weight_unpack
from runtime.model import linear
from runtime.model.quantized import GROUP_SIZE, Int4Weight, Int8Weight

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def _time(fn, repeats: int) -> float:  # median ms
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    dense = [torch.randn(n, k) * 0.02 for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    int4 = [Int4Weight.quantize(w) for w in dense]
    bf16 = [(w.bfloat16(), linear.pack(w.bfloat16())) for w in dense]
    f32 = [(w, linear.pack(w)) for w in dense]
    head = Int8Weight.quantize(torch.randn(49152, 576) * 0.02)
    head_bf16 = head.dequantize().bfloat16()
    head_packed = linear.pack(head_bf16)
    rows_list = [1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512] if not args.quick else [1, 16, 64]
    repeats = 2 if args.quick else 5
    result = {}
    with torch.inference_mode():
        for rows in rows_list:
            xs = {k: torch.randn(rows, k).bfloat16() for _, k in LAYER_SHAPES}
            xf = {k: x.float() for k, x in xs.items()}
            paths = {
                "int4_kernel": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[w.in_features], w.packed,
                                                                                   GROUP_SIZE, w.scales_zeros)
                                        for w in int4],
                "int4_unpack_bf16": lambda: [F.linear(xs[w.in_features], weight_unpack.unpack_int4(w.packed,
                                                                                                  w.scales_zeros))
                                             for w in int4],
                "dense_bf16_onednn": lambda: [linear.linear(xs[w.shape[1]], w, None, p) for w, p in bf16],
                "dense_f32_onednn": lambda: [linear.linear(xf[w.shape[1]], w, None, p) for w, p in f32],
                "head_int8_kernel": lambda: torch._weight_int8pack_mm(xs[576], head.q, head._kernel_scale),
                "head_int8_unpack_bf16": lambda: F.linear(xs[576], weight_unpack.unpack_int8(head.q, head.scale)),
                "head_dense_bf16_onednn": lambda: linear.linear(xs[576], head_bf16, None, head_packed),
            }
            if quant_matmul.available():
                paths["int4_bf16_dot"] = lambda: [quant_matmul.int4_matmul(xs[w.in_features], w.packed,
                                                                           w.scales_zeros) for w in int4]
                paths["int4_bf16_dot_few_rows"] = lambda: [quant_matmul.int4_matmul_few_rows(
                    xs[w.in_features], w.packed, w.scales_zeros) for w in int4]
                paths["head_int8_bf16_dot"] = lambda: quant_matmul.int8_matmul(xs[576], head.q, head.scale)
            result[rows] = {name: round(_time(fn, repeats), 3) for name, fn in paths.items()}
            log(f"rows {rows}: {result[rows]} (ms per 30-layer pass / per LM head)")
    write_result("quantized_linear", args.quick, {"machine": machine_info(), "ms": result})


if __name__ == "__main__":
    main()
