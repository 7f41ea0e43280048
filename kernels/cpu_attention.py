"""The CPU's paged decode attention in C++ (kernels/csrc/paged_decode.cpp), built on first use.

One query token per sequence attends to positions [starts[i], ends[i]) of its page table,
read from the pages in place: no gather of K/V into a padded copy, no mask tensor. It
returns the log-sum-exp beside the output so that kernels/cascade.py can merge it with a
shared prefix's part. kernels/cpu_extension.py builds it; where it cannot, `available()` is
False and the callers take the torch path.
"""

from __future__ import annotations

import torch

from kernels import cpu_extension


def _extension():
    return cpu_extension.load("paged_decode.cpp")


def available() -> bool:
    """Whether the C++ decode kernel is built (building it on the first call)."""
    return _extension() is not None


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], float32 or bfloat16
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], q's dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], q's dtype
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    starts: torch.Tensor,  # int32 [num_seqs]; first position each row attends to
    ends: torch.Tensor,  # int32 [num_seqs]; one past the last
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [num_seqs, num_q_heads, head_dim] in q's dtype, lse float32 [num_seqs, num_q_heads]
    """Attention of each row's query over positions [starts, ends) of its pages, with its log-sum-exp.

    A row with an empty range gets zeros and lse -inf. Raises ValueError on inconsistent
    shapes or dtypes, or a range or page outside the table or cache; RuntimeError where the
    kernel is not available.
    """
    module = _extension()
    if module is None:
        raise RuntimeError("the C++ CPU attention kernel is not available (see the cpu_kernels.unavailable log)")
    out, lse = module.paged_decode(q.contiguous(), k_cache, v_cache, block_tables.contiguous(), starts.contiguous(),
                                   ends.contiguous(), float(scale))
    return out, lse


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], each token's [H, D] contiguous
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], likewise
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], key's dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
) -> None:
    """Copy each token's K and V rows into its slot (one call; kernels/reference.write_kv is the oracle).

    Raises ValueError on mismatched shapes or dtypes or a slot outside the cache; RuntimeError where
    the kernel is not available.
    """
    module = _extension()
    if module is None:
        raise RuntimeError("the C++ CPU attention kernel is not available (see the cpu_kernels.unavailable log)")
    module.write_kv(key, value, k_cache, v_cache, slot_mapping)
