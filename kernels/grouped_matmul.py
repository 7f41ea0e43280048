"""x @ W.T for a weight kept in ggml's own groups (kernels/csrc/grouped_matmul.cpp), with its references.

A grouped weight [N, K] (runtime/model/grouped.py makes one from a GGUF tensor):

    value[n, k] = int(codes[n, k]) * scale[n, k // G] (+ zero[n, k // G])

    codes  4-bit: uint8 [N, K // 2]; per group of 32 inputs 16 bytes, byte j = input j in the low
                  nibble, input j + 16 in the high one; int(nibble) = table[nibble], table int8 [16]
           8-bit: int8 [N, K], int(code) = code
    scale  float32 [N, K // G]        G = 32 (4-bit codes: always), or 16
    zero   float32 [N, K // G], or None (no zero term at all)

    reference  grouped_values (the weight in any float dtype; float32: exactly the file's values),
               grouped_matmul_reference: x @ W.T in float64
    kernel     grouped_matmul: x float32 [M, K] -> float32 [M, N], the weights made in float32 exactly
               (one fma per weight), the sums in float32 FMAs in one order whatever M (a few rows:
               weights decoded in registers; many: decoded into a cached block), so a row's result
               does not depend on the rows beside it
               grouped_unpack: rows [start, end) of W in float32
    torch      grouped_matmul_torch: the same result through torch ops (blocks of W made by
               grouped_values, then torch's matmul), where the C++ cannot build
               (PAGEDSERVE_CPU_KERNELS=torch, no compiler)
    check      tests/kernels/test_grouped_matmul.py: within float32 accumulation of the float64 reference
"""

from __future__ import annotations

import functools

import torch

from kernels import cpu_extension

UNPACK_BLOCK_VALUES = 1 << 21  # weights made at a time by the torch path (8 MiB of float32)


@functools.cache
def _extension(portable: bool = False):
    """The compiled kernel; `portable` builds the plain C++ path (no AVX2/FMA), for its tests."""
    return cpu_extension.load("grouped_matmul.cpp", ("-mno-avx2", "-mno-fma") if portable else ())


def available() -> bool:
    """Whether the C++ kernel runs here (built now if not yet)."""
    return _extension() is not None


def _table(table: torch.Tensor | None) -> torch.Tensor:
    return table if table is not None else torch.empty(0, dtype=torch.int8)


def _zero(zero: torch.Tensor | None) -> torch.Tensor:
    return zero if zero is not None else torch.empty(0, dtype=torch.float32)


def grouped_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, table: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:  # dtype [N, K]
    """The weight's values computed in `dtype` (float32: one rounding per weight, the file's values exactly)."""
    n, groups = scale.shape
    if codes.dtype == torch.uint8:  # nibbles, per 32 inputs: 16 low, then 16 high
        pairs = codes.view(n, groups, 16)
        nibbles = torch.stack((pairs & 0x0F, pairs >> 4), dim=-2).view(n, groups, 32)
        ints = table[nibbles.long()]
    else:
        ints = codes.view(n, groups, -1)
    values = ints.to(dtype) * scale.to(dtype)[..., None]
    if zero is not None:
        values = values + zero.to(dtype)[..., None]
    return values.view(n, -1)


def grouped_matmul_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                             table: torch.Tensor | None) -> torch.Tensor:  # float64 [M, N]
    """x [M, K] @ W.T in float64, W the file's float32 values (exact in float64)."""
    return x.double() @ grouped_values(codes, scale, zero, table).double().T


def grouped_matmul_torch(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                         table: torch.Tensor | None) -> torch.Tensor:  # float32 [M, N]
    """x float32 [M, K] @ W.T by torch ops: W made in blocks of output rows, each multiplied by torch's matmul."""
    n, k = scale.shape[0], x.shape[1]
    step = max(1, UNPACK_BLOCK_VALUES // k)
    parts = [x @ grouped_values(codes[start:start + step], scale[start:start + step],
                                None if zero is None else zero[start:start + step], table).T
             for start in range(0, n, step)]
    return torch.cat(parts, dim=1)


def grouped_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                   table: torch.Tensor | None, loop: str = "auto", portable: bool = False) -> torch.Tensor:
    """x float32 [M, K] @ W.T -> float32 [M, N] by the C++ kernel (needs `available()`).

    `loop`: "auto" (by the number of rows), or "few" / "many" to force one of the two loops (they
    agree bit for bit; the tests check it).
    """
    group = x.shape[1] // scale.shape[1]
    direct = {"auto": -1, "few": 1, "many": 0}[loop]
    return _extension(portable).grouped_matmul(x.contiguous(), codes, scale, _zero(zero), _table(table), group, direct)


def grouped_unpack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, table: torch.Tensor | None,
                   start: int, end: int, portable: bool = False) -> torch.Tensor:  # float32 [end - start, K]
    """Rows [start, end) of W, the file's values, by the C++ kernel (needs `available()`)."""
    group = (codes.shape[1] * (2 if codes.dtype == torch.uint8 else 1)) // scale.shape[1]
    return _extension(portable).grouped_unpack(codes, scale, _zero(zero), _table(table), group, start, end)
