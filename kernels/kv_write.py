r"""KV write in Triton: each new token's K and V rows into its slot of the paged cache.

    k_cache[slot // block_size, slot % block_size] = key[t]      for every token t,
    v_cache[slot // block_size, slot % block_size] = value[t]    slot = slot_mapping[t]

Layouts:
    key, value        [num_tokens, num_kv_heads, head_dim]  (last dim contiguous; may be views
                      into a fused qkv projection)
    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping      int64 [num_tokens]; slot = block_id * block_size + offset

One program per token copies that token's [num_kv_heads, head_dim] K and V rows, cast to
the cache dtype; one launch per layer. Every slot must be a real one (>= 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_checks import DTYPES, check


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # int64 [num_tokens]
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two of NUM_KV_HEADS
    HEAD_DIM_PAD: tl.constexpr,  # next power of two of HEAD_DIM
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]  # [HEADS_PAD, HEAD_DIM_PAD]
    cache_offsets = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    k = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
) -> None:
    """Triton KV write; same effect as kernels.reference.write_kv.

    Raises ValueError on shapes, dtypes, devices or strides the kernel cannot take.
    """
    op = "write_kv"
    check(op, key.dim() == 3, f"key must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    check(op, value.shape == key.shape, f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    check(op, k_cache.dim() == 4,
          f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    check(op, v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    check(op, v_cache.stride() == k_cache.stride(), "k_cache and v_cache must have the same strides")
    num_tokens, num_kv_heads, head_dim = key.shape
    check(op, tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim),
          f"key rows are [{num_kv_heads}, {head_dim}], cache rows {tuple(k_cache.shape[2:])}")
    check(op, k_cache.dtype in DTYPES and v_cache.dtype == k_cache.dtype,
          f"k_cache and v_cache must share a dtype in {DTYPES}, got {k_cache.dtype}, {v_cache.dtype}")
    check(op, key.dtype in DTYPES and value.dtype in DTYPES,
          f"key/value dtypes {key.dtype}, {value.dtype} not in {DTYPES}")
    check(op, slot_mapping.dtype == torch.int64 and slot_mapping.shape == (num_tokens,),
          f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in {"value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}.items():
        check(op, t.device == key.device, f"{name} is on {t.device}, key on {key.device}")
    for name, t in {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache}.items():
        check(op, t.numel() == 0 or t.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
    )


__all__ = ["write_kv"]
