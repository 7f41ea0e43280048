r"""Attention through page tables for one step's flat batch of tokens.

A step's tokens are laid out flat, decodes first (one token each), then prefill chunks:

    tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
             \____decodes___/\________chunks_______/

Each layer writes the new K/V rows into their slots, then the decode tokens go through
paged_decode_attention and the chunks through paged_prefill_attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the pages and what each one attends to."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # int32 [num_decodes, max_blocks]; None when decode_plans have the pages
    decode_context_lens: torch.Tensor  # int32 [num_decodes]
    prefill_block_tables: torch.Tensor  # int32 [num_prefills, max_blocks]
    prefill_query_start_loc: torch.Tensor  # int32 [num_prefills + 1], offsets into the chunk rows
    prefill_context_lens: torch.Tensor  # int32 [num_prefills]
    backend: kernels.AttentionBackend = kernels.ATTENTION_BACKENDS["torch"]  # the runner's (kernels.attention_backend)
    # a backend that reads decode plans: who shares which prefix pages, one plan per distinct sliding window of
    # the layers (None: none)
    decode_plans: dict[int | None, kernels.DecodePlan] | None = None


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], rotated
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Write this step's K/V into the pages, then attend each token through its page table.

    `softcap`: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2).
    """
    backend = meta.backend
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    num_decode = meta.num_decode_tokens
    parts = []
    if num_decode:
        plan = meta.decode_plans[sliding_window] if meta.decode_plans else None
        parts.append(backend.decode(q[:num_decode], k_cache, v_cache, meta.decode_block_tables,
                                    meta.decode_context_lens, scale, sliding_window, plan, softcap))
    if num_decode < q.shape[0]:
        parts.append(backend.prefill(q[num_decode:], k_cache, v_cache, meta.prefill_block_tables,
                                     meta.prefill_query_start_loc, meta.prefill_context_lens, scale, sliding_window,
                                     softcap))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
