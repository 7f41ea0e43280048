"""x @ W.T for a weight kept in ggml's own groups (kernels/csrc/grouped_matmul.cpp), with its references.

A grouped weight [N, K] (runtime/model/grouped.py makes one from a GGUF tensor):

    value[n, k] = int(codes[n, k]) * scale[n, k // G] (+ zero[n, k // G])

    codes  4-bit: uint8 [N, K // 2]; per group of 32 inputs 16 bytes, byte j = input j in the low
                  nibble, input j + 16 in the high one; int(nibble) = table[nibble], table int8 [16]
           8-bit: int8 [N, K], int(code) = code
    scale  float32 [N, K // G]        G = 32 (4-bit codes: always), or 16
    zero   float32 [N, K // G], or None (no zero term at all)

    A scale or zero may be float16 where that holds each value exactly (narrowed: the f16 that Q4_0,
    Q4_1, Q5_x, Q8_0 and IQ4_NL store; half the bytes, the same values).

    A scale or zero may instead be Factored, as the K-quants store them: int8 [N, K // G] times a
    float32 (or, where that holds it exactly, float16) unit per run of P groups, units [N, K // (G P)],
    P a multiple of 8 (Q4_K: d * sc, 8 groups of 32 to a unit, d the file's f16). The product is exact
    in float32, so both forms give the same values; the factored one takes 8 + 16 / P bits a group
    instead of 32 (Q4_K: 4.625 bits a weight, the file's 4.5).

    The panel layout (to_panels; N a multiple of PANEL, what the models use) keeps the same integers
    with 16 outputs' groups interleaved, so that one 64-byte load holds 8 inputs (4-bit) or 4 inputs
    (8-bit) of each of 16 outputs, and one byte shuffle in registers gathers each output's 4 bytes into
    its own 32-bit lane (the byte order: kernels/csrc/grouped_matmul.cpp): codes [N / 16, K // G, 16 * group bytes], scale and zero
    [N / 16, K // G, 16] (a Factored one's units [N / 16, K // (G P), 16]). Every function here takes
    either layout; to_rows and select_rows give the row layout back.

    6-bit codes (panels only; to_panels(..., bits=6)) hold 8-bit codes in [-32, 31], as Q6_K's q - 32
    and Q5_x's are, in 6 bits instead of 8: per load the 4-bit layout of q = code + 32's low 4 bits, then
    32 bytes of its high 2 bits: uint8 codes [N / 16, K // G, 16 * 3 G / 4], no table, G = 16 or 32. Their
    row layout (to_rows, select_rows) is the 8-bit one, the same integers.

    reference  grouped_values (the weight in any float dtype; float32: exactly the file's values),
               grouped_matmul_reference: x @ W.T in float64
    kernel     grouped_matmul: x float32 [M, K] -> float32 [M, N]: x rounded to int8 per block of G inputs
               (d = max|x| / 127: 2^-8 of the block's largest value, as llama.cpp's Q8_0 activations;
               quantize_activations, and its torch twin activation_blocks_reference, bit for bit), each
               group's integer dot product exact (vpdpbusd / vpmaddubsw), then one fma per group into the lane of the group's number
               mod 8, the 8 lanes reduced by a fixed tree (the zero terms likewise, apart). Factored scales
               (the K-quants; activation_span says when) take the unit arithmetic: x rounded per unit span
               (P G inputs, 256 for Q4_K and Q6_K, as llama.cpp's Q8_K), a unit's groups summed in int32
               with their ints, one fma per unit into the lane of the unit's number mod 8. Either way a row's
               result does not depend on the rows beside it, and the layouts and the AVX-512, AVX2 and
               plain builds agree to the bit (tests: the build this CPU makes and the plain one). Only
               the panel layout has vector loops (runtime/model/grouped.py pads any N to panels).
               grouped_unpack: rows [start, end) of W in float32; grouped_rows: rows by id
    check      tests/kernels/test_grouped_matmul.py: within float32 arithmetic of (x rounded) @ W.T in float64
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from kernels import cpu_extension

PANEL = 16  # outputs side by side per group in the panel layout
SIX_OFFSET = 32  # a 6-bit code's q = code + 32, in 0..63
SIX_LOW, SIX_HIGH = 64, 32  # a 6-bit load: bytes of low nibbles, then of high bits (8 inputs of 16 outputs)
UNPACK_BLOCK_VALUES = 1 << 21  # weights made at a time by the torch path (8 MiB of float32)
ACTIVATION_MAX = 127.0  # the kernel's activations: int8 in [-127, 127] per block


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
    """Group scales (or zeros) as int8 times a float32 or float16 unit per `per_unit` groups, in a weight's layout."""
    ints: torch.Tensor  # int8 [N, groups] (rows) or [N / 16, groups, 16] (panels)
    units: torch.Tensor  # float32 or float16 [N, groups // per_unit] or [N / 16, groups // per_unit, 16]

    @property
    def per_unit(self) -> int:
        return self.ints.shape[1] // self.units.shape[1]

    def floats(self) -> torch.Tensor:  # float32, shaped as ints: each value exactly int * unit
        return self.ints.float() * self.units.float().repeat_interleave(self.per_unit, dim=1)

    def map(self, fn) -> Factored:  # fn applied to both (a layout change or a selection along the outputs)
        return Factored(fn(self.ints), fn(self.units))

    def nbytes(self) -> int:
        return self.ints.numel() + self.units.element_size() * self.units.numel()


Scales = torch.Tensor | Factored  # a weight's scales or zeros: float32 or float16 per group, or factored


def factor(ints: torch.Tensor, units: torch.Tensor) -> Factored:
    """A Factored from int8-valued ints [N, groups] and units [N, groups // P] (P a multiple of 8), as float32
    (`narrowed` makes them float16 where that is exact)."""
    ints = ints.to(torch.int8).contiguous()
    units = units.float().contiguous()
    if units.shape[0] != ints.shape[0] or ints.shape[1] % units.shape[1] or (ints.shape[1] // units.shape[1]) % 8:
        raise ValueError(f"factored scales: {tuple(ints.shape)} ints need units of one per 8k groups, "
                         f"got {tuple(units.shape)}")
    return Factored(ints, units)


def each(scale: Scales, fn) -> Scales:
    """fn applied to float scales, or to both tensors of a Factored (a layout change, a selection of outputs)."""
    return scale.map(fn) if isinstance(scale, Factored) else fn(scale)


def floats(scale: Scales | None) -> torch.Tensor | None:
    """Scales or zeros as float32 in their layout (a Factored or float16 one made float32: exact)."""
    if scale is None:
        return None
    return scale.floats() if isinstance(scale, Factored) else scale.float()


def narrowed(scale: Scales | None) -> Scales | None:
    """float32 scales or zeros, or a Factored one's units, as float16 where float16 holds every one exactly
    (the same values in half the bytes: the f16 a file stores, as Q4_0's d or Q4_K's d and dmin), else as
    they are."""
    if isinstance(scale, Factored):
        return Factored(scale.ints, narrowed(scale.units))
    if isinstance(scale, torch.Tensor) and scale.dtype == torch.float32:
        half = scale.half()
        if torch.equal(half.float(), scale):
            return half
    return scale


def scales_nbytes(scale: Scales | None) -> int:
    if scale is None:
        return 0
    return scale.nbytes() if isinstance(scale, Factored) else scale.element_size() * scale.numel()


def _panels_of(values: torch.Tensor) -> torch.Tensor:  # [N, count] -> [N / 16, count, 16]
    n, count = values.shape
    return values.view(n // PANEL, PANEL, count).transpose(1, 2).contiguous()


def _ints_of(codes: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """Row-layout codes as one byte per input, uint8 [N, groups, G]: nibbles (4-bit) or int8 codes' bytes."""
    if codes.dtype == torch.uint8:  # per 32 inputs: 16 low nibbles, then 16 high
        pairs = codes.view(n, groups, 16)
        return torch.stack((pairs & 0x0F, pairs >> 4), dim=-2).view(n, groups, 32)
    return codes.view(torch.uint8).view(n, groups, -1)


def to_panels(codes: torch.Tensor, scale: Scales, zero: Scales | None,
              bits: int | None = None) -> tuple[torch.Tensor, Scales, Scales | None]:
    """Row-layout codes [N, bytes], scale and zero [N, groups] in the panel layout (N a multiple of PANEL);
    bits=6 packs int8 codes in [-32, 31] as 6-bit codes (else uint8 codes stay 4-bit and int8 ones 8-bit)."""
    n, groups = _shape(scale)
    if n % PANEL or codes.dim() != 2:
        raise ValueError(f"the panel layout takes row-layout codes of a multiple of {PANEL} outputs, not {tuple(codes.shape)}")
    return panels_of_ints(_ints_of(codes, n, groups), bits or (4 if codes.dtype == torch.uint8 else 8), scale, zero)


def fits_six_bits(ints: torch.Tensor) -> bool:
    """Whether 8-bit codes (int8, or their bytes as uint8) all lie in [-32, 31], the 6-bit codes' range."""
    codes = ints.view(torch.int8)
    return codes.numel() == 0 or (int(codes.min()) >= -SIX_OFFSET and int(codes.max()) < SIX_OFFSET)


def panels_of_ints(ints: torch.Tensor, bits: int, scale: Scales,
                   zero: Scales | None) -> tuple[torch.Tensor, Scales, Scales | None]:
    """The panel layout from one byte per input, uint8 [N, groups, G] (a nibble for bits=4, else an int8 code's
    byte: bits=6 packs codes in [-32, 31] into 6 bits), and scale and zero [N, groups]; N a multiple of PANEL."""
    n, groups, group = ints.shape
    if bits not in (4, 6, 8) or (bits == 6 and not fits_six_bits(ints)):
        raise ValueError(f"{bits}-bit panels take nibbles (4), int8 codes in [-32, 31] (6) or int8 codes (8)")
    if bits == 6:  # q = code + 32: its low nibbles laid out as 4-bit codes, its high 2 bits in 32 bytes after each load
        q = (ints.view(torch.int8).to(torch.int16) + SIX_OFFSET).to(torch.uint8)
        low = _nibble_loads(q & 0x0F)  # [N / 16, groups, loads, 64 positions, h]
        high = _nibble_loads(q >> 4)
        positions = high[..., 0] | (high[..., 1] << 2)  # [N / 16, groups, loads, 64]: position p's nibble
        top = positions[..., :SIX_HIGH] | (positions[..., SIX_HIGH:] << 4)  # byte b: positions b and b + 32
        placed = torch.cat([low[..., 0] | (low[..., 1] << 4), top], dim=-1)  # [N / 16, groups, loads, 96]
    elif bits == 4:
        placed = _nibble_loads(ints)
        placed = placed[..., 0] | (placed[..., 1] << 4)
    else:  # output 4c + t's input 4j + 2s + e -> load j, byte 16c + 8s + 2t + e: [.., j, c, s, t, e]
        placed = ints.view(n // PANEL, 4, 4, groups, group // 4, 2, 2).permute(0, 3, 4, 1, 5, 2, 6)
    panel_codes = placed.reshape(n // PANEL, groups, -1).contiguous()
    if bits == 8:
        panel_codes = panel_codes.view(torch.int8)
    return panel_codes, each(scale, _panels_of), None if zero is None else each(zero, _panels_of)


def _nibble_loads(ints: torch.Tensor) -> torch.Tensor:  # uint8 [N, groups, G] -> [N / 16, groups, G / 8, 64, 2]
    """One value per input placed as the nibble loads hold them: output 4c + t's input 8j + 4h + 2s + e -> load j,
    byte 16c + 8s + 2t + e, nibble h ([N / 16, c, t, groups, j, h, s, e] -> [N / 16, groups, j, c, s, t, e, h])."""
    n, groups, group = ints.shape
    placed = ints.view(n // PANEL, 4, 4, groups, group // 8, 2, 2, 2).permute(0, 3, 4, 1, 6, 2, 7, 5)
    return placed.reshape(n // PANEL, groups, group // 8, 64, 2)


def six_bit(codes: torch.Tensor) -> bool:
    """Whether panel-layout codes are 6-bit (uint8 with 3 G / 4 bytes an output's group; 4-bit ones have 16)."""
    return codes.dtype == torch.uint8 and codes.dim() == 3 and codes.shape[2] != PANEL * 16


def padded(codes: torch.Tensor, scale: Scales, zero: Scales | None,
           count: int) -> tuple[torch.Tensor, Scales, Scales | None]:
    """Row-layout codes (or one byte per input), scale and zero with `count` outputs of zeros after the last
    (value 0 * 0 + 0)."""
    grow = lambda values: torch.cat([values, values.new_zeros(count, *values.shape[1:])])  # noqa: E731
    return grow(codes), each(scale, grow), None if zero is None else each(zero, grow)


def to_rows(codes: torch.Tensor, scale: Scales, zero: Scales | None = None) -> tuple[torch.Tensor, Scales, Scales | None]:
    """Codes, scale and zero in the row layout, from either layout (rows come back as they are)."""
    if codes.dim() == 2:
        return codes, scale, zero
    return select_rows(codes, scale, zero, torch.arange(codes.shape[0] * PANEL))


def select_rows(codes: torch.Tensor, scale: Scales, zero: Scales | None,
                ids: torch.Tensor) -> tuple[torch.Tensor, Scales, Scales | None]:
    """Outputs `ids` [R] of either layout, in the row layout: codes [R, bytes], scale and zero [R, groups].

    From panels, only each id's own bytes are gathered (an embedding lookup from a tied head, every step)."""
    if codes.dim() == 2:
        pick = lambda values: values[ids]  # noqa: E731
        return codes[ids], each(scale, pick), None if zero is None else each(zero, pick)
    count, groups = codes.shape[:2]
    panel, output = ids // PANEL, ids % PANEL  # [R] each; output 4c + t
    pick = lambda values: values[panel, :, output]  # noqa: E731  [N / 16, count, 16] -> [R, count]
    if six_bit(codes):
        return _six_rows(codes, panel, output), each(scale, pick), None if zero is None else each(zero, pick)
    four = codes.dtype == torch.uint8
    data = codes.view(torch.uint8).view(count, groups, -1, 4, 2, 4, 2)  # [N / 16, groups, j, c, s, t, e]
    own = data[panel, :, :, output // 4, :, output % 4, :]  # [R, groups, j, s, e]
    if four:  # input 8j + 4h + 2s + e: [R, groups, j, s, e, h] -> [R, groups, j, h, s, e]
        ints = torch.stack((own & 0x0F, own >> 4), dim=-1).permute(0, 1, 2, 5, 3, 4).reshape(len(ids), groups, 32)
        row_codes = (ints[..., :16] | (ints[..., 16:] << 4)).reshape(len(ids), groups * 16)
    else:  # input 4j + 2s + e: already in order
        row_codes = own.reshape(len(ids), groups * own.shape[2] * 4).view(torch.int8)
    return row_codes, each(scale, pick), None if zero is None else each(zero, pick)


def _six_rows(codes: torch.Tensor, panel: torch.Tensor, output: torch.Tensor) -> torch.Tensor:  # int8 [R, K]
    """Outputs (panel, output) [R] of 6-bit panel codes as 8-bit row-layout codes (only each output's own bytes
    gathered: to_rows of every output reads each byte once)."""
    count, groups = codes.shape[:2]
    loads = codes.view(count, groups, -1, SIX_LOW + SIX_HIGH)  # [N / 16, groups, j, 96]
    c, t = output // 4, output % 4  # [R] each
    # low nibbles: byte 16c + 8s + 2t + e of the 64; high bits: position p = 16c + 8s + 2t + e's nibble, the low
    # half of byte p (p < 32) or the high half of byte p - 32 of the 32
    low = loads[..., :SIX_LOW].unflatten(-1, (4, 2, 4, 2))[panel, :, :, c, :, t, :]  # [R, groups, j, s, e]
    top = loads[..., SIX_LOW:].unflatten(-1, (2, 2, 4, 2))[panel, :, :, c % 2, :, t, :]  # [R, groups, j, s, e]
    high = (top >> (4 * (c // 2)).to(torch.uint8).view(-1, 1, 1, 1, 1)) & 0x0F
    q = torch.stack(((low & 0x0F) | ((high & 3) << 4), (low >> 4) | ((high >> 2) << 4)), dim=-1)  # [R, groups, j, s, e, h]
    q = q.permute(0, 1, 2, 5, 3, 4).reshape(len(panel), -1)  # input 8j + 4h + 2s + e
    return (q.to(torch.int16) - SIX_OFFSET).to(torch.int8)


def _shape(scale: Scales) -> tuple[int, int]:
    """(N, groups) of scales in the row layout."""
    values = scale.ints if isinstance(scale, Factored) else scale
    return (values.shape[0] * PANEL if values.dim() == 3 else values.shape[0]), values.shape[1]


def _group(codes: torch.Tensor, scale: Scales) -> int:
    """G: inputs per group of the weight, in either layout."""
    if six_bit(codes):
        return codes.shape[2] // PANEL * 4 // 3
    if codes.dtype == torch.uint8:
        return 32
    return codes.shape[2] // PANEL if codes.dim() == 3 else codes.shape[1] // _shape(scale)[1]


def _kernel_scales(scale: Scales | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, units) as the C++ kernel takes them: float32 or float16 and no units, int8 and units, or none."""
    if scale is None:
        return _NONE, _NONE
    return (scale.ints, scale.units) if isinstance(scale, Factored) else (scale, _NONE)


def grouped_values(codes: torch.Tensor, scale: Scales, zero: Scales | None, table: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:  # dtype [N, K]
    """The weight's values computed in `dtype` (float32: one rounding per weight, the file's values exactly)."""
    codes, scale, zero = to_rows(codes, scale, zero)
    scale, zero = floats(scale), floats(zero)
    n, groups = scale.shape
    ints = _ints_of(codes, n, groups)  # uint8 [N, groups, G]
    ints = table[ints.long()] if codes.dtype == torch.uint8 else ints.view(torch.int8)
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
    per = PANEL if codes.dim() == 3 else 1  # outputs per first index of codes, scale and zero
    step = max(1, UNPACK_BLOCK_VALUES // (k * per))  # in first indices
    parts = [x @ grouped_values(codes[start:start + step], scale[start:start + step],
                                None if zero is None else zero[start:start + step], table).T
             for start in range(0, codes.shape[0], step)]
    return torch.cat(parts, dim=1)


def kernel_call(codes: torch.Tensor, scale: Scales, zero: Scales | None, table: torch.Tensor | None,
                portable: bool = False):
    """The C++ kernel (needs `available()`) for one weight, its arguments bound once (a decode step makes ~120
    calls): x float32 [M, K] -> x @ W.T float32 [M, N], x in int8 blocks."""
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
    """x float32 [M, K] @ W.T -> float32 [M, N] by the C++ kernel (needs `available()`), x in int8 blocks."""
    return kernel_call(codes, scale, zero, table, portable)(x)


def activation_span(codes: torch.Tensor, scale: Scales, zero: Scales | None, table: torch.Tensor | None) -> int:
    """Inputs to one block of the C++ kernel's int8 activations for this weight, as the kernel decides it (needs
    `available()`): G, or a factored weight's unit span (P G, Q4_K's and Q6_K's 256) where it does the unit
    arithmetic (scales factored, zeros none or factored with the same units, the span at most 1,024)."""
    return _extension().activation_span(*kernel_arguments(codes, scale, zero, table))


def quantize_activations(x: torch.Tensor, span: int, portable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own int8 blocks of x float32 [M, K]: q int8 [M, K], d float32 [M, K // span]."""
    q, d = _extension(portable).quantize_activations(x.contiguous(), span)
    return q, d


def activation_blocks_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel rounds x float32 [M, K] to, by torch ops: q int8 [M, K], d float32 [M, K // group].

    Per block of `group` inputs (activation_span's): d = max|x| / 127, q = round(x * (127 / max|x|)) to nearest even
    (all zero for an all-zero block, and for one so small that 127 / max|x| is no float32: d = 0; d NaN and
    q 0 for a block with a NaN or an infinity).
    """
    m, k = x.shape
    blocks = x.float().reshape(m, k // group, group)
    amax = blocks.abs().amax(-1)  # [M, K // group]
    finite = torch.isfinite(blocks).all(-1)
    limit = torch.full_like(amax, ACTIVATION_MAX)  # a tensor: torch divides by a Python number as a reciprocal's product
    d = torch.where(finite, amax / limit, torch.full_like(amax, float("nan")))
    inverse = torch.where(finite & (amax > 0), limit / amax, torch.zeros_like(amax))
    tiny = torch.isinf(inverse)  # max|x| < 127 / FLT_MAX: the block rounds to zeros
    d, inverse = torch.where(tiny, torch.zeros_like(d), d), torch.where(tiny, torch.zeros_like(inverse), inverse)
    scaled = torch.where(finite[..., None], blocks * inverse[..., None], torch.zeros_like(blocks))
    q = scaled.round().clamp(-ACTIVATION_MAX, ACTIVATION_MAX).to(torch.int8)
    return q.reshape(m, k), d


def rounded_activations(x: torch.Tensor, group: int) -> torch.Tensor:  # float64 [M, K]
    """x as the kernel multiplies it: q * d of its int8 blocks, exactly (in float64)."""
    q, d = activation_blocks_reference(x, group)
    m, k = x.shape
    return (q.double().reshape(m, k // group, group) * d.double()[..., None]).reshape(m, k)


def grouped_unpack(codes: torch.Tensor, scale: Scales, zero: Scales | None, table: torch.Tensor | None,
                   start: int, end: int, portable: bool = False) -> torch.Tensor:  # float32 [end - start, K]
    """Rows [start, end) of W, the file's values, by the C++ kernel (needs `available()`)."""
    (scale_values, scale_units), (zero_values, zero_units) = _kernel_scales(scale), _kernel_scales(zero)
    return _extension(portable).grouped_unpack(codes, scale_values, scale_units, zero_values, zero_units,
                                               _table(table), _group(codes, scale), start, end)


def grouped_rows(codes: torch.Tensor, scale: Scales, zero: Scales | None, table: torch.Tensor | None,
                 ids: torch.Tensor, portable: bool = False) -> torch.Tensor:  # float32 [R, K]
    """Rows `ids` int64 [R] of W, the file's values (grouped_values(...)[ids] to the bit), by the C++ kernel (needs
    `available()`): only each id's bytes are read (an embedding lookup from a tied head, every step)."""
    (scale_values, scale_units), (zero_values, zero_units) = _kernel_scales(scale), _kernel_scales(zero)
    return _extension(portable).grouped_rows(codes, scale_values, scale_units, zero_values, zero_units,
                                             _table(table), _group(codes, scale), ids.reshape(-1).to(torch.int64))
