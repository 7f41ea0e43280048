"""x @ W.T for weight-only quantized CPU weights in AVX512-BF16 dot products (kernels/csrc/quant_matmul.cpp).

    reference  int4_few_rows_reference: the unrounded weight (q - 8) * scale + zero, float64 matmul
               (both int4 kernels)
               int8_matmul_reference: (x @ q.T) * scale in float64
    kernel     int4_matmul_few_rows: torch's packed int4 CPU layout, for a few rows; the weight's nibbles
               read by table into bfloat16 (exact), each group's scale and zero applied to its dot
               products, never to the weight
               int4_matmul: the same arithmetic for many rows, each 64-output block's nibbles unpacked
               once per call into cache and every row multiplied there: equal to int4_matmul_few_rows
               bit for bit, whatever the number of rows
               int8_matmul: per-row int8 (the LM head), 16 rows converted at a time, dot products along
               the inputs, the scale applied once at the end
    check      tests/kernels/test_quant_matmul.py: within float32 accumulation of the reference

Built only where the CPU has AVX512-BF16 (`available()`: AMD Zen 4 and later, Intel Cooper Lake,
Sapphire Rapids and later); elsewhere runtime/model/quantized.py keeps torch's kernels and the
whole-layer unpack.
"""

from __future__ import annotations

import functools

import torch

from kernels import cpu_extension, weight_unpack

CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_bf16"})


@functools.cache
def _extension():
    if not CPU_FLAGS <= cpu_extension.cpu_flags():
        return None  # not built: the source would compile to a module that can do nothing
    return cpu_extension.load("quant_matmul.cpp")


@functools.cache
def available() -> bool:
    """Whether the kernels run here: the CPU has AVX512-BF16 and the source builds (built now if not yet)."""
    ext = _extension()
    return ext is not None and bool(ext.available())


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
    """x bfloat16 [M, K] @ W.T -> float32 [M, N] (bfloat16 if bf16_out); needs `available()`, N % 64 == 0, K % 32 == 0."""
    return _extension().int4_matmul(x.contiguous(), packed, scales_zeros, bf16_out)


def int4_few_rows_reference(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x bfloat16 [M, K] @ ((q - 8) * scale + zero).T in float64 [M, N], the weight not rounded."""
    return x.double() @ weight_unpack.int4_values(packed, scales_zeros, torch.float64).T


def int4_matmul_few_rows(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                         bf16_out: bool = False) -> torch.Tensor:
    """x bfloat16 [M, K] (a few rows) @ W.T -> float32 [M, N] (bfloat16 if bf16_out), W unrounded; as int4_matmul's shapes."""
    return _extension().int4_matmul_few_rows(x.contiguous(), packed, scales_zeros, bf16_out)


def int8_matmul_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # float64 [M, N]
    """x bfloat16 [M, K] @ (q int8 [N, K] * scale float32 [N]).T, in float64."""
    return (x.double() @ q.double().T) * scale.double()


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
    """x bfloat16 [M, K] @ (q * scale).T -> float32 [M, N] (bfloat16 if bf16_out); needs `available()`, K % 32 == 0,
    N % 16 == 0."""
    return _extension().int8_matmul(x.contiguous(), q, scale, bf16_out)
