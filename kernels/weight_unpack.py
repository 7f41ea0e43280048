"""Quantized CPU weights back to dense bfloat16, for the matmuls of many rows (kernels/csrc/weight_unpack.cpp).

    reference  unpack_int4_reference / unpack_int8_reference: torch ops, the oracle
    kernel     unpack_int4 / unpack_int8: C++ (one pass, both cores), or None where it cannot build
    check      tests/kernels/test_weight_unpack.py: the kernel equals the reference bit for bit

torch's int4 CPU layout (read off the packing op; runtime/model/quantized.py pads rows to a
multiple of 64 so that only this form occurs): blocks of B rows, each [in_features][B / 2]
bytes; byte j of column k holds the block's row j in its low nibble and row j + B / 2 in its
high one. B is 64 where torch packs for AVX-512 and 32 where it packs for AVX2: `block_rows()`
finds out by packing a probe once.
"""

from __future__ import annotations

import functools

import torch

from kernels import cpu_extension

GROUP = 32


def _extension():
    return cpu_extension.load("weight_unpack.cpp", ("-ffp-contract=off",))  # no FMA: the reference's rounding


def available() -> bool:
    """Whether the C++ unpack builds here (built now if it is not yet)."""
    return _extension() is not None


@functools.cache
def block_rows() -> int:
    """Rows per block of torch's packed int4 layout on this CPU (32 or 64), read off the packing op."""
    rows, cols = 128, 64
    q = (torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols) * 7 // 3) % 16  # [rows, cols] codes
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # uint8 [rows, cols // 2]
    for block in (64, 32):
        tiles = packed.reshape(rows // block, cols, block // 2)
        if torch.equal(torch.cat((tiles & 0x0F, tiles >> 4), dim=2).permute(0, 2, 1).reshape(rows, cols).int(), q):
            return block
    raise RuntimeError("torch's packed int4 CPU layout is neither of the known ones (blocks of 32 or 64 rows)")


def int4_values(
    packed: torch.Tensor,  # uint8 [N, K // 2], torch's packed int4 CPU layout, N a multiple of 64
    scales_zeros: torch.Tensor,  # bfloat16 [K // 32, N, 2]
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # dtype [N, K]: (q - 8) * scale + zero, computed in dtype
    n, k = packed.shape[0], packed.shape[1] * 2
    block = block_rows()
    tiles = packed.reshape(n // block, k, block // 2)  # [block, column, j]
    low, high = (tiles & 0x0F), (tiles >> 4)  # rows j and j + block / 2 of each block
    q = torch.cat((low, high), dim=2).permute(0, 2, 1).reshape(n, k).to(dtype)  # [N, K]
    scale = scales_zeros[..., 0].to(dtype).T.repeat_interleave(GROUP, dim=1)  # [N, K]
    zero = scales_zeros[..., 1].to(dtype).T.repeat_interleave(GROUP, dim=1)
    return (q - 8) * scale + zero


def unpack_int4_reference(
    packed: torch.Tensor,  # uint8 [N, K // 2], torch's packed int4 CPU layout, N a multiple of 64
    scales_zeros: torch.Tensor,  # bfloat16 [K // 32, N, 2]
) -> torch.Tensor:  # bfloat16 [N, K]: (q - 8) * scale + zero in float32, rounded once
    return int4_values(packed, scales_zeros).to(torch.bfloat16)


def unpack_int8_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # bfloat16 [N, K]
    return (q.float() * scale.float()[:, None]).to(torch.bfloat16)


def unpack_int4(packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor | None:
    """The C++ unpack (bfloat16 [N, K]), or None where the extension is not available."""
    ext = _extension()
    return None if ext is None else ext.unpack_int4(packed, scales_zeros, block_rows())


def unpack_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    ext = _extension()
    return None if ext is None else ext.unpack_int8(q, scale)
