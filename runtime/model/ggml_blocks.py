"""llama.cpp's tensor encodings (ggml types) turned into torch tensors, one weight at a time.

A quantized ggml weight is stored row by row, each row a run of blocks along its input
dimension (32 values per block for the legacy types and IQ4_NL; 256 for the K-quants and
IQ4_XS). The types kept in their own groups (`unpack_groups`), as llama.cpp defines them:

    Q4_0    [d f16][16 B: nibbles]                          (q - 8) d                 per 32
    Q4_1    [d f16][m f16][16 B: nibbles]                   q d + m                   per 32
    IQ4_NL  [d f16][16 B: nibbles]                          kvalues[q] d              per 32
    Q5_0    [d f16][qh 4 B][16 B: nibbles]                  (q - 16) d                per 32
    Q5_1    [d f16][m f16][qh 4 B][16 B: nibbles]           q d + m                   per 32
    Q8_0    [d f16][32 x int8 q]                            q d                       per 32
    Q4_K    [d, dmin f16][12 B: 6-bit sc, m][128 B nibbles] (d sc) q - (dmin m)       per 32 of 256
    Q5_K    [d, dmin f16][12 B sc, m][qh 32 B][128 B]       (d sc) q - (dmin m)       per 32 of 256
    Q6_K    [ql 128 B][qh 64 B][sc 16 x int8][d f16]        (d sc) (q - 32)           per 16 of 256
    IQ4_XS  [d f16][sc_h 2 B][sc_l 4 B][128 B nibbles]      (d (sc - 32)) kvalues[q]  per 32 of 256

"nibbles" of a 32-value block: byte j holds value j (low) and value j + 16 (high); Q4_K and
Q5_K hold 64 values per 32 bytes instead (value j low, j + 32 high), and the 5th/6th bits come
from qh. kvalues is llama.cpp's 16-entry int8 table (gguf.quants.IQ4_NL.kvalues).

Every such value is `code * scale + zero` of a group: the code a small integer, the scale and
zero float32 as ggml computes them (d * sc in float32 is exact: an 11-bit f16 times a <= 8-bit
integer; the K-quants' and IQ4_XS's stay so factored, sc int8 per group and d per 256 values:
kernels/grouped_matmul.Factored, multiplied out to the same floats); code * scale is exact too
(<= 24 significant bits), so the one rounding is the addition, as in ggml. `Groups.values` and
`dequantize` therefore give llama.cpp's float32 bits; other types are handed to `gguf.quants` (bit for bit by definition). `unpack_q4` and
`unpack_q8_0` give the Q4_0/Q4_1 and Q8_0 integers and block scales for the int4/int8 forms.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL
from gguf.quants import _type_traits as _GGUF_TYPES

from kernels.grouped_matmul import Scales, factor, floats

QK = 32  # values per block of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL
QK_K = 256  # values per block of the K-quants and IQ4_XS

_ids = {t.name: int(t) for t in GGMLQuantizationType}
F32, F16, BF16 = _ids["F32"], _ids["F16"], _ids["BF16"]
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = _ids["Q4_0"], _ids["Q4_1"], _ids["Q5_0"], _ids["Q5_1"], _ids["Q8_0"]
Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = _ids["Q4_K"], _ids["Q5_K"], _ids["Q6_K"], _ids["IQ4_NL"], _ids["IQ4_XS"]
# the types this runtime reads: the float types and every type llama.cpp's own reader dequantizes
TYPE_NAMES = {qtype: GGMLQuantizationType(qtype).name
              for qtype in sorted({F32, F16, BF16} | {int(t) for t in _GGUF_TYPES})}
SUPPORTED_TYPES = frozenset(TYPE_NAMES)
FLOAT_TYPES = frozenset({F32, F16, BF16})
GROUPED_TYPES = frozenset({Q4_0, Q4_1, IQ4_NL, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS})  # `unpack_groups` reads
FOUR_BIT_TYPES = frozenset({Q4_0, Q4_1, IQ4_NL, Q4_K, IQ4_XS})  # codes are nibbles 0..15 read through a table
BLOCK_BYTES = {qtype: GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1] for qtype in GROUPED_TYPES}
BLOCK_VALUES = {qtype: GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0] for qtype in GROUPED_TYPES}
IQ4_VALUES = torch.tensor(_GGUF_IQ4_NL.kvalues, dtype=torch.int8)  # int8 [16], llama.cpp's kvalues_iq4nl
IDENTITY4 = torch.arange(16, dtype=torch.int8)  # a nibble's value as itself
SIGNED4 = IDENTITY4 - 8  # Q4_0: q - 8


class UnsupportedTensorType(ValueError):
    """A ggml type this runtime does not read (named by the caller with its tensor and file)."""


class Groups(NamedTuple):
    """A matrix as ggml groups it: value[r, k] = lookup(code[r, k]) * scale[r, k // group] (+ zero[r, k // group]).

    codes: uint8 [rows, cols] nibbles 0..15 when `table` (int8 [16]) is set, which maps them to
    their integers; else int8 [rows, cols], the integers themselves. scale, zero: float32
    [rows, cols // group], or Factored (the K-quants: int8 per group times a unit per 256 values);
    zero None where the type has none (a zero of 0.0 would turn ggml's -0.0 into +0.0).
    """
    codes: torch.Tensor
    scale: Scales
    zero: Scales | None
    group: int
    table: torch.Tensor | None

    def integers(self) -> torch.Tensor:  # int8 [rows, cols]
        return self.codes.view(torch.int8) if self.table is None else self.table[self.codes.long()]

    def values(self) -> torch.Tensor:  # float32 [rows, cols], llama.cpp's bits
        rows, cols = self.codes.shape
        values = self.integers().view(rows, cols // self.group, self.group).float() * floats(self.scale)[..., None]
        if self.zero is not None:
            values = values + floats(self.zero)[..., None]
        return values.view(rows, cols)


def type_name(qtype: int) -> str:
    if int(qtype) in TYPE_NAMES:
        return TYPE_NAMES[int(qtype)]
    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return f"type {int(qtype)}"


def _blocks(raw: np.ndarray, qtype: int, rows: int, cols: int) -> torch.Tensor:  # uint8 [rows, blocks, bytes]
    per_block = BLOCK_VALUES[qtype]
    if cols % per_block:
        raise UnsupportedTensorType(f"{type_name(qtype)} needs a multiple of {per_block} columns, got {cols}")
    data = torch.from_numpy(np.array(raw).view(np.uint8).reshape(-1))  # a copy: the map is read-only
    expected = rows * (cols // per_block) * BLOCK_BYTES[qtype]
    if data.numel() != expected:
        raise UnsupportedTensorType(f"{type_name(qtype)} data of {data.numel()} bytes for [{rows}, {cols}] "
                                    f"(expected {expected})")
    return data.view(rows, cols // per_block, BLOCK_BYTES[qtype])


def _f16(pair: torch.Tensor) -> torch.Tensor:  # uint8 [..., 2] -> float32 [...]
    return pair.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:  # uint8 [..., n] -> uint8 [..., 2n]: all low nibbles, then high
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _bits(packed: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """uint8 [..., n] -> uint8 [..., count, n]: field i (bits i*width ..) of every byte."""
    shifts = torch.arange(count, dtype=torch.uint8)[:, None] * width
    return (packed[..., None, :] >> shifts) & ((1 << width) - 1)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> (sc, m) uint8 [..., 8], six bits each.

    Bytes 0-3: sc 0-3 in their low 6 bits (top 2 bits: sc 4-7's high bits); bytes 4-7: m 0-3
    likewise (top bits: m 4-7's high bits); bytes 8-11: sc 4-7 low nibble, m 4-7 high nibble.
    """
    low_sc, low_m, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat((low_sc & 0x3F, (rest & 0x0F) | ((low_sc >> 6) << 4)), dim=-1)
    m = torch.cat((low_m & 0x3F, (rest >> 4) | ((low_m >> 6) << 4)), dim=-1)
    return sc, m


def _fifth_bit(qh: torch.Tensor) -> torch.Tensor:  # uint8 [..., 4] (a little-endian uint32) -> uint8 [..., 32]
    return _bits(qh, 8).transpose(-1, -2).reshape(*qh.shape[:-1], 32)


def unpack_groups(raw: np.ndarray, qtype: int, rows: int, cols: int) -> Groups:
    """One of GROUPED_TYPES as its codes and group scales (the values exactly as llama.cpp's)."""
    blocks = _blocks(raw, qtype, rows, cols)  # [rows, nb, bytes]
    nb = blocks.shape[1]
    if qtype in (Q4_0, IQ4_NL, Q4_1):
        start = 4 if qtype == Q4_1 else 2
        zero = _f16(blocks[..., 2:4]) if qtype == Q4_1 else None
        table = {Q4_0: SIGNED4, IQ4_NL: IQ4_VALUES, Q4_1: IDENTITY4}[qtype]
        return Groups(_nibbles(blocks[..., start:]).reshape(rows, cols), _f16(blocks[..., 0:2]), zero, QK, table)
    if qtype in (Q5_0, Q5_1):
        start = 8 if qtype == Q5_1 else 6
        q = _nibbles(blocks[..., start:]) | (_fifth_bit(blocks[..., start - 4:start]) << 4)  # [rows, nb, 32] 0..31
        if qtype == Q5_0:
            return Groups((q.to(torch.int8) - 16).reshape(rows, cols), _f16(blocks[..., 0:2]), None, QK, None)
        return Groups(q.view(torch.int8).reshape(rows, cols), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]), QK, None)
    if qtype == Q8_0:
        return Groups(blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols), _f16(blocks[..., 0:2]), None,
                      QK, None)
    if qtype in (Q4_K, Q5_K):
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, nb]
        sc, m = _k_scales(blocks[..., 4:16])  # [rows, nb, 8]
        scale = factor(sc.reshape(rows, -1), d)  # d * sc: [rows, cols // 32]
        zero = factor(m.reshape(rows, -1), -dmin)  # -(dmin * m): the same float, sign and all
        low = blocks[..., -128:].reshape(rows, nb, 4, 32)  # 4 x 64 values: low nibbles 32 values, high the next 32
        q = _nibbles(low).reshape(rows, nb, 8, 32)  # sub-block j = 2 c + (high)
        if qtype == Q4_K:
            return Groups(q.reshape(rows, cols), scale, zero, QK, IDENTITY4)
        high = _bits(blocks[..., 16:48], 8)  # [rows, nb, 8, 32]: bit j of qh[i] is sub-block j's value i's 5th bit
        return Groups((q | (high << 4)).view(torch.int8).reshape(rows, cols), scale, zero, QK, None)
    if qtype == Q6_K:
        ql, qh = blocks[..., 0:128].reshape(rows, nb, 2, 64), blocks[..., 128:192].reshape(rows, nb, 2, 32)
        low = torch.cat((ql & 0x0F, ql >> 4), dim=-1).reshape(rows, nb, 2, 4, 32)  # per 128: four runs of 32
        high = _bits(qh, 4, 2)  # [rows, nb, 2, 4, 32]: run t's two high bits at bits 2t..2t+1 of qh[i]
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(rows, cols)
        scale = factor(blocks[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1), _f16(blocks[..., 208:210]))
        return Groups(q, scale, None, 16, None)
    if qtype == IQ4_XS:
        d = _f16(blocks[..., 0:2])
        high = _bits(blocks[..., 2:4], 4, 2).transpose(-1, -2).reshape(rows, nb, 8)  # 2 bits per sub-block, LE
        low = _bits(blocks[..., 4:8], 2, 4).transpose(-1, -2).reshape(rows, nb, 8)
        ls = (low | (high << 4)).to(torch.int8) - 32
        scale = factor(ls.reshape(rows, -1), d)
        q = _nibbles(blocks[..., 8:].reshape(rows, nb, 8, 16))
        return Groups(q.reshape(rows, cols), scale, None, QK, IQ4_VALUES)
    raise UnsupportedTensorType(f"{type_name(qtype)} is not kept in groups")


def unpack_q4(raw: np.ndarray, qtype: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 or Q4_1 as (q uint8 [rows, cols] in 0..15, d float32 [rows, cols // 32], m float32 [rows, cols // 32]).

    value = q * d + m; for Q4_0, m = -8 d, written out here so both types share one form.
    """
    if qtype not in (Q4_0, Q4_1):
        raise UnsupportedTensorType(f"{type_name(qtype)} is not a 4-bit type")
    groups = unpack_groups(raw, qtype, rows, cols)
    return groups.codes, groups.scale, groups.zero if qtype == Q4_1 else groups.scale * -8.0


def unpack_q8_0(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 as (q int8 [rows, cols], d float32 [rows, cols // 32]); value = q * d."""
    groups = unpack_groups(raw, Q8_0, rows, cols)
    return groups.codes, groups.scale


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:  # float32 `shape`
    """The tensor's float32 values, bit for bit as `gguf.quants.dequantize` gives them.

    `raw` is the tensor's data as the gguf reader maps it; `shape` is its torch shape
    ([rows, cols] for a matrix). Raises UnsupportedTensorType for other types.
    """
    qtype = int(qtype)
    rows, cols = (1, shape[0]) if len(shape) == 1 else (int(np.prod(shape[:-1])), shape[-1])
    if qtype == F32:
        out = torch.from_numpy(np.array(raw).view(np.float32))
    elif qtype == F16:
        out = torch.from_numpy(np.array(raw).view(np.float16)).float()
    elif qtype == BF16:
        bits = torch.from_numpy(np.array(raw).view(np.int16))
        out = (bits.to(torch.int32) << 16).view(torch.float32)
    elif qtype in GROUPED_TYPES:
        out = unpack_groups(raw, qtype, rows, cols).values()
    elif qtype in SUPPORTED_TYPES:  # the rest (Q2_K, Q3_K, the IQ2/IQ3/IQ1 grids, ...): llama.cpp's own numpy code
        from gguf.quants import dequantize as gguf_dequantize

        out = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(np.asarray(raw), qtype), dtype=np.float32))
    else:
        raise UnsupportedTensorType(f"tensor type {type_name(qtype)} is not supported "
                                    f"(supported: {', '.join(TYPE_NAMES.values())})")
    if out.numel() != rows * cols:
        raise UnsupportedTensorType(f"{type_name(qtype)} data holds {out.numel()} values, not {rows * cols}")
    return out.reshape(shape)
