"""x @ W.T for a weight kept in ggml's own groups (kernels/csrc/grouped_matmul.cpp), with its references.

A grouped weight [N, K] (runtime/model/grouped.py makes one from a GGUF tensor):

    value[n, k] = int(codes[n, k]) * scale[n, k // G] (+ zero[n, k // G])

    codes  4-bit: uint8 [N, K // 2]; per group of 32 inputs 16 bytes, byte j = input j in the low
                  nibble, input j + 16 in the high one; int(nibble) = table[nibble], table int8 [16]
           8-bit: int8 [N, K], int(code) = code
    scale  float32 [N, K // G]        G = 32 (4-bit codes: always), or 16
    zero   float32 [N, K // G], or None (no zero term at all)

    A scale or zero may instead be Factored, as the K-quants store them: int8 [N, K // G] times a
    float32 unit per run of P groups, units [N, K // (G P)], P a multiple of 8 (Q4_K: d * sc, 8 groups
    of 32 to a unit). The product is exact in float32, so both forms give the same values; the
    factored one takes 8 + 32 / P bits a group instead of 32 (Q4_K: 4.75 bits a weight, not 6).

    The quad layout (to_quads; N a multiple of QUAD) keeps the same bytes with the groups of 4
    outputs side by side, so a decode step's one row reads 4 outputs as one stream of memory:
    codes [N / 4, K // G, 4, group bytes] and scale [N / 4, K // G, 4] (a Factored one's units
    [N / 4, K // (G P), 4]); zero stays [N, K // G].
    Every function here takes either layout. The kernel's one-row loop over it takes 4 outputs per load
    of the row's block (two to a register with AVX-512) and prefetches the weight stream: ~2x the row
    layout's speed at one row on an AMX Xeon (BENCHMARKS.md section 23), to the same bits.

    reference  grouped_values (the weight in any float dtype; float32: exactly the file's values),
               grouped_matmul_reference: x @ W.T in float64
    kernel     grouped_matmul: x float32 [M, K] -> float32 [M, N]: x rounded to int16 per block of G inputs
               (d = max|x| / 32767: 2^-16 of the block's largest value; quantize_activations, and its
               torch twin activation_blocks_reference, bit for bit), each group's integer dot product
               exact (vpmaddwd), then one fma per group and 8 lanes reduced by a fixed tree: a row's
               result does not depend on the rows beside it, and the AVX2 and plain builds agree to
               the bit. (llama.cpp rounds activations to int8 per 32: 2^-8.)
               grouped_unpack: rows [start, end) of W in float32
    check      tests/kernels/test_grouped_matmul.py: within float32 arithmetic of (x rounded) @ W.T in float64
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from kernels import cpu_extension

QUAD = 4  # outputs side by side per group in the quad layout
UNPACK_BLOCK_VALUES = 1 << 21  # weights made at a time by the torch path (8 MiB of float32)
ACTIVATION_MAX = 32767.0  # the kernel's activations: int16 in [-32767, 32767] per block


@functools.cache
def _extension(portable: bool = False):
    """The compiled kernel; `portable` builds the plain C++ path (no AVX2/FMA), for its tests."""
    return cpu_extension.load("grouped_matmul.cpp", ("-mno-avx2", "-mno-fma") if portable else ())


def available() -> bool:
    """Whether the C++ kernel runs here (built now if not yet)."""
    return _extension() is not None


_NO_TABLE = torch.empty(0, dtype=torch.int8)  # the kernel's "none" (made once: a decode step makes ~120 calls)
_NONE = torch.empty(0, dtype=torch.float32)  # no zero, or no units


def _table(table: torch.Tensor | None) -> torch.Tensor:
    return table if table is not None else _NO_TABLE


class Factored(NamedTuple):
    """Group scales (or zeros) as int8 times a float32 unit per `per_unit` groups, in a weight's layout."""
    ints: torch.Tensor  # int8 [N, groups] (rows) or [N / 4, groups, 4] (quads)
    units: torch.Tensor  # float32 [N, groups // per_unit] or [N / 4, groups // per_unit, 4]

    @property
    def per_unit(self) -> int:
        return self.ints.shape[1] // self.units.shape[1]

    def floats(self) -> torch.Tensor:  # float32, shaped as ints: each value exactly int * unit
        return self.ints.float() * self.units.repeat_interleave(self.per_unit, dim=1)

    def map(self, fn) -> Factored:  # fn applied to both (a layout change or a selection along the outputs)
        return Factored(fn(self.ints), fn(self.units))

    def nbytes(self) -> int:
        return self.ints.numel() + 4 * self.units.numel()


Scales = torch.Tensor | Factored  # a weight's scales or zeros: float32 per group, or factored


def factor(ints: torch.Tensor, units: torch.Tensor) -> Factored:
    """A Factored from int8-valued ints [N, groups] and float32 units [N, groups // P] (P a multiple of 8)."""
    ints = ints.to(torch.int8).contiguous()
    units = units.float().contiguous()
    if units.shape[0] != ints.shape[0] or ints.shape[1] % units.shape[1] or (ints.shape[1] // units.shape[1]) % 8:
        raise ValueError(f"factored scales: {tuple(ints.shape)} ints need units of one per 8k groups, "
                         f"got {tuple(units.shape)}")
    return Factored(ints, units)


def each(scale: Scales, fn) -> Scales:
    """fn applied to float32 scales, or to both tensors of a Factored (a layout change, a selection of outputs)."""
    return scale.map(fn) if isinstance(scale, Factored) else fn(scale)


def floats(scale: Scales | None) -> torch.Tensor | None:
    """Scales or zeros as float32 in their layout (a Factored one multiplied out: exact)."""
    return scale.floats() if isinstance(scale, Factored) else scale


def scales_nbytes(scale: Scales | None) -> int:
    if scale is None:
        return 0
    return scale.nbytes() if isinstance(scale, Factored) else 4 * scale.numel()


def _quads_of(values: torch.Tensor) -> torch.Tensor:  # [N, count] -> [N / 4, count, 4]
    n, count = values.shape
    return values.view(n // QUAD, QUAD, count).transpose(1, 2).contiguous()


def _rows_of(values: torch.Tensor) -> torch.Tensor:  # [N / 4, count, 4] -> [N, count]
    quads, count = values.shape[:2]
    return values.transpose(1, 2).reshape(quads * QUAD, count)


def to_quads(codes: torch.Tensor, scale: Scales) -> tuple[torch.Tensor, Scales]:
    """Row-layout codes [N, bytes] and scale [N, groups] in the quad layout (N a multiple of QUAD)."""
    n, groups = _shape(scale)
    if n % QUAD:
        raise ValueError(f"the quad layout needs a multiple of {QUAD} outputs, not {n}")
    quads = codes.view(n // QUAD, QUAD, groups, -1).transpose(1, 2).contiguous()  # [N / 4, groups, 4, bytes]
    return quads, each(scale, _quads_of)


def to_rows(codes: torch.Tensor, scale: Scales) -> tuple[torch.Tensor, Scales]:
    """Codes and scale in the row layout, from either layout (rows come back as they are)."""
    if codes.dim() == 2:
        return codes, scale
    quads = codes.shape[0]
    return (codes.transpose(1, 2).reshape(quads * QUAD, -1),  # [N, bytes]
            each(scale, _rows_of))  # [N, groups]


def select_rows(codes: torch.Tensor, scale: Scales, ids: torch.Tensor) -> tuple[torch.Tensor, Scales]:
    """Outputs `ids` [R] of either layout, in the row layout: codes [R, bytes], scale [R, groups]."""
    if codes.dim() == 2:
        return codes[ids], each(scale, lambda values: values[ids])
    picked = codes[ids // QUAD, :, ids % QUAD].reshape(len(ids), -1)
    return picked, each(scale, lambda values: values[ids // QUAD, :, ids % QUAD])


def _shape(scale: Scales) -> tuple[int, int]:
    """(N, groups) of scales in the row layout."""
    values = scale.ints if isinstance(scale, Factored) else scale
    return (values.shape[0] * QUAD if values.dim() == 3 else values.shape[0]), values.shape[1]


def _group(codes: torch.Tensor, scale: Scales) -> int:
    """G: inputs per group of the weight, in either layout."""
    if codes.dtype == torch.uint8:
        return 32
    return codes.shape[3] if codes.dim() == 4 else codes.shape[1] // _shape(scale)[1]


def _kernel_scales(scale: Scales | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, units) as the C++ kernel takes them: float32 and no units, int8 and units, or none."""
    if scale is None:
        return _NONE, _NONE
    return (scale.ints, scale.units) if isinstance(scale, Factored) else (scale, _NONE)


def grouped_values(codes: torch.Tensor, scale: Scales, zero: Scales | None, table: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:  # dtype [N, K]
    """The weight's values computed in `dtype` (float32: one rounding per weight, the file's values exactly)."""
    codes, scale = to_rows(codes, scale)
    scale, zero = floats(scale), floats(zero)
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


def grouped_matmul_reference(x: torch.Tensor, codes: torch.Tensor, scale: Scales, zero: Scales | None,
                             table: torch.Tensor | None) -> torch.Tensor:  # float64 [M, N]
    """x [M, K] @ W.T in float64, W the file's float32 values (exact in float64)."""
    return x.double() @ grouped_values(codes, scale, zero, table).double().T


def grouped_matmul_torch(x: torch.Tensor, codes: torch.Tensor, scale: Scales, zero: Scales | None,
                         table: torch.Tensor | None) -> torch.Tensor:  # float32 [M, N]
    """x float32 [M, K] @ W.T by torch ops: W made in blocks of output rows, each multiplied by torch's matmul."""
    scale, zero = floats(scale), floats(zero)
    k = x.shape[1]
    per = QUAD if codes.dim() == 4 else 1  # outputs per first index of codes and scale
    step = max(1, UNPACK_BLOCK_VALUES // (k * per))  # in first indices
    parts = [x @ grouped_values(codes[start:start + step], scale[start:start + step],
                                None if zero is None else zero[start * per:(start + step) * per], table).T
             for start in range(0, codes.shape[0], step)]
    return torch.cat(parts, dim=1)


def kernel_call(codes: torch.Tensor, scale: Scales, zero: Scales | None, table: torch.Tensor | None,
                portable: bool = False):
    """The C++ kernel (needs `available()`) for one weight, its arguments bound once (a decode step makes ~120
    calls): x float32 [M, K] -> x @ W.T float32 [M, N], x in int16 blocks."""
    run, arguments = _extension(portable).grouped_matmul, kernel_arguments(codes, scale, zero, table)

    def call(x: torch.Tensor) -> torch.Tensor:
        return run(x if x.is_contiguous() else x.contiguous(), *arguments)

    return call


def kernel_arguments(codes: torch.Tensor, scale: Scales, zero: Scales | None, table: torch.Tensor | None) -> tuple:
    """The C++ kernel's arguments after x: (codes, scale, scale_units, zero, zero_units, table, group)."""
    (scale_values, scale_units), (zero_values, zero_units) = _kernel_scales(scale), _kernel_scales(zero)
    return codes, scale_values, scale_units, zero_values, zero_units, _table(table), _group(codes, scale)


def grouped_matmul(x: torch.Tensor, codes: torch.Tensor, scale: Scales, zero: Scales | None,
                   table: torch.Tensor | None, portable: bool = False) -> torch.Tensor:
    """x float32 [M, K] @ W.T -> float32 [M, N] by the C++ kernel (needs `available()`), x in int16 blocks."""
    return kernel_call(codes, scale, zero, table, portable)(x)


def quantize_activations(x: torch.Tensor, group: int, portable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own int16 blocks of x float32 [M, K]: q int16 [M, K], d float32 [M, K // group]."""
    q, d, _ = _extension(portable).quantize_activations(x.contiguous(), group, False)
    return q, d


def activation_blocks_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel rounds x float32 [M, K] to, by torch ops: q int16 [M, K], d float32 [M, K // group].

    Per block of `group` inputs: d = max|x| / 32767, q = round(x * (32767 / max|x|)) to nearest even
    (all zero for an all-zero block; d NaN and q 0 for a block with a NaN or an infinity).
    """
    m, k = x.shape
    blocks = x.float().reshape(m, k // group, group)
    amax = blocks.abs().amax(-1)  # [M, K // group]
    finite = torch.isfinite(blocks).all(-1)
    limit = torch.full_like(amax, ACTIVATION_MAX)  # a tensor: torch divides by a Python number as a reciprocal's product
    d = torch.where(finite, amax / limit, torch.full_like(amax, float("nan")))
    inverse = torch.where(finite & (amax > 0), limit / amax, torch.zeros_like(amax))
    scaled = torch.where(finite[..., None], blocks * inverse[..., None], torch.zeros_like(blocks))
    q = scaled.round().clamp(-ACTIVATION_MAX, ACTIVATION_MAX).to(torch.int16)
    return q.reshape(m, k), d


def rounded_activations(x: torch.Tensor, group: int) -> torch.Tensor:  # float64 [M, K]
    """x as the kernel multiplies it: q * d of its int16 blocks, exactly (in float64)."""
    q, d = activation_blocks_reference(x, group)
    m, k = x.shape
    return (q.double().reshape(m, k // group, group) * d.double()[..., None]).reshape(m, k)


def grouped_unpack(codes: torch.Tensor, scale: Scales, zero: Scales | None, table: torch.Tensor | None,
                   start: int, end: int, portable: bool = False) -> torch.Tensor:  # float32 [end - start, K]
    """Rows [start, end) of W, the file's values, by the C++ kernel (needs `available()`)."""
    (scale_values, scale_units), (zero_values, zero_units) = _kernel_scales(scale), _kernel_scales(zero)
    return _extension(portable).grouped_unpack(codes, scale_values, scale_units, zero_values, zero_units,
                                               _table(table), _group(codes, scale), start, end)
