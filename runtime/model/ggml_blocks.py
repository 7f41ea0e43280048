"""llama.cpp's tensor encodings (ggml types) turned into torch tensors, one weight at a time.

A quantized ggml weight is stored row by row, each row a run of blocks along its input
dimension (32 values per block for Q4_0, Q4_1 and Q8_0; 256 for the K-quants):

    Q8_0  [d: f16][32 x int8 q]                     value = q * d
    Q4_0  [d: f16][16 bytes: q0..15 low, q16..31 high nibbles]      value = (q - 8) * d
    Q4_1  [d: f16][m: f16][16 bytes, nibbles as Q4_0]               value = q * d + m

`dequantize` gives float32 exactly as llama.cpp's `gguf.quants.dequantize` does (the same
float32 operations in the same order, so the same bits); the 4- and 8-bit types are unpacked
here in torch, the K-quants are handed to `gguf.quants`. `unpack_q4` and `unpack_q8_0` give
the integer values and per-block scales, which runtime/model/quantized.py keeps as they are.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK = 32  # values per block of Q4_0, Q4_1 and Q8_0

# the types this runtime reads, as llama.cpp's own reader numbers and sizes them
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = (int(GGMLQuantizationType[name]) for name in (
    "F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16"))
TYPE_NAMES = {qtype: GGMLQuantizationType(qtype).name for qtype in (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)}
SUPPORTED_TYPES = frozenset(TYPE_NAMES)
BLOCK_BYTES = {qtype: GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1] for qtype in (Q8_0, Q4_0, Q4_1)}  # per 32 values


class UnsupportedTensorType(ValueError):
    """A ggml type this runtime does not read (named by the caller with its tensor and file)."""


def type_name(qtype: int) -> str:
    if int(qtype) in TYPE_NAMES:
        return TYPE_NAMES[int(qtype)]
    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return f"type {int(qtype)}"


def _blocks(raw: np.ndarray, qtype: int, rows: int, cols: int) -> torch.Tensor:  # uint8 [rows, cols // QK, bytes]
    if cols % QK:
        raise UnsupportedTensorType(f"{type_name(qtype)} needs a multiple of {QK} columns, got {cols}")
    data = torch.from_numpy(np.array(raw).view(np.uint8).reshape(-1))  # a copy: the map is read-only
    expected = rows * (cols // QK) * BLOCK_BYTES[qtype]
    if data.numel() != expected:
        raise UnsupportedTensorType(f"{type_name(qtype)} data of {data.numel()} bytes for [{rows}, {cols}] "
                                    f"(expected {expected})")
    return data.view(rows, cols // QK, BLOCK_BYTES[qtype])


def _f16(pair: torch.Tensor) -> torch.Tensor:  # uint8 [..., 2] -> float32 [...]
    return pair.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:  # uint8 [..., 16] -> uint8 [..., 32], ggml's element order
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def unpack_q4(raw: np.ndarray, qtype: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 or Q4_1 as (q uint8 [rows, cols] in 0..15, d float32 [rows, cols // 32], m float32 [rows, cols // 32]).

    value = q * d + m; for Q4_0, m = -8 d, written out here so both types share one form.
    """
    blocks = _blocks(raw, qtype, rows, cols)
    d = _f16(blocks[..., 0:2])
    if qtype == Q4_0:
        m = d * -8.0
        q = _nibbles(blocks[..., 2:])
    elif qtype == Q4_1:
        m = _f16(blocks[..., 2:4])
        q = _nibbles(blocks[..., 4:])
    else:
        raise UnsupportedTensorType(f"{type_name(qtype)} is not a 4-bit type")
    return q.reshape(rows, cols), d, m


def unpack_q8_0(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 as (q int8 [rows, cols], d float32 [rows, cols // 32]); value = q * d."""
    blocks = _blocks(raw, Q8_0, rows, cols)
    return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols), _f16(blocks[..., 0:2])


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
    elif qtype in (Q4_0, Q4_1):
        q, d, m = unpack_q4(raw, qtype, rows, cols)
        q = q.view(rows, cols // QK, QK)
        if qtype == Q4_0:  # (q - 8) * d, as ggml computes it
            out = (q.to(torch.int8) - 8).float() * d[..., None]
        else:
            out = d[..., None] * q.float() + m[..., None]
    elif qtype == Q8_0:
        q, d = unpack_q8_0(raw, rows, cols)
        out = q.view(rows, cols // QK, QK).float() * d[..., None]
    elif qtype in SUPPORTED_TYPES:  # the K-quants: llama.cpp's own numpy code
        from gguf.quants import dequantize as gguf_dequantize

        out = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(np.asarray(raw), qtype), dtype=np.float32))
    else:
        raise UnsupportedTensorType(f"tensor type {type_name(qtype)} is not supported "
                                    f"(supported: {', '.join(TYPE_NAMES.values())})")
    if out.numel() != rows * cols:
        raise UnsupportedTensorType(f"{type_name(qtype)} data holds {out.numel()} values, not {rows * cols}")
    return out.reshape(shape)
