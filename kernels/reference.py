"""Torch reference kernels for paged attention: the CPU backend and the oracle for Triton.

Layouts (shared by every backend):
    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables      int32 [num_seqs, max_blocks_per_seq]; row i lists the physical pages of
                      sequence i in token order (entries past its last page are ignored)
    context_lens      int32 [num_seqs]; tokens of K/V (cached + new) each sequence attends to
    slot              block_id * block_size + offset

A query token at position p attends to the K/V at positions 0..p of its own sequence
(causal), or, with a sliding window W, to positions p-W+1..p.

Softmax and the weighted sum run in float32 whatever the cache dtype; outputs come back in
the query's dtype. With a soft-cap c (Gemma 2) each score s becomes c * tanh(s / c) before the
mask and the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
) -> None:
    """Store each new token's K/V row into its slot of the paged cache."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_pages(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # int32 [..., max_blocks]
) -> torch.Tensor:
    """Gather a page table's pages into a contiguous [..., max_blocks * block_size, kv, d] view."""
    pages = cache.index_select(0, block_table.reshape(-1))  # [n_pages, block_size, num_kv_heads, head_dim]
    return pages.view(*block_table.shape[:-1], block_table.shape[-1] * cache.shape[1], cache.shape[2], cache.shape[3])


def _attend(
    q: torch.Tensor,  # float32 [batch, num_q_heads, q_len, head_dim]
    k: torch.Tensor,  # float32 [batch, num_kv_heads, kv_len, head_dim]
    v: torch.Tensor,  # float32 [batch, num_kv_heads, kv_len, head_dim]
    visible: torch.Tensor,  # bool, broadcast to [batch, num_q_heads, q_len, kv_len]
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # float32 [batch, num_q_heads, q_len, head_dim]
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap  # [batch, heads, q_len, kv_len]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """One query token per sequence (the newest, at position context_len - 1) over its pages."""
    keys = _gather_pages(k_cache, block_tables)  # [num_seqs, max_ctx, num_kv_heads, head_dim]
    values = _gather_pages(v_cache, block_tables)
    max_ctx = keys.shape[1]
    kv_pos = torch.arange(max_ctx, device=q.device)  # [max_ctx]
    lens = context_lens.long()[:, None]  # [num_seqs, 1]
    visible = kv_pos[None, :] < lens  # [num_seqs, max_ctx]
    if sliding_window is not None:
        visible &= kv_pos[None, :] >= lens - sliding_window
    out = _attend(
        q.float()[:, :, None, :],  # [num_seqs, num_q_heads, 1, head_dim]
        keys.float().transpose(1, 2),  # [num_seqs, num_kv_heads, max_ctx, head_dim]
        values.float().transpose(1, 2),
        visible[:, None, None, :],  # [num_seqs, 1, 1, max_ctx]
        scale,
        softcap,
    )  # [num_seqs, num_q_heads, 1, head_dim]
    return out[:, :, 0, :].to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]; seq i owns q rows [loc[i], loc[i+1])
    context_lens: torch.Tensor,  # int32 [num_seqs]; cached + new tokens of each sequence
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """A ragged batch of query chunks, each attending causally to its cached pages and itself.

    Sequence i's query rows are its newest tokens, positions
    context_len - q_len .. context_len - 1; its K/V for all context_len positions, the new
    ones included, are already in the pages (write_kv runs first).

        pages:  |  cached (prefix hit or earlier chunks)  |  this chunk  |
        query:                                             q0 q1 ... q_{n-1}
        q_j sees every cached position and the chunk up to itself.
    """
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    out = torch.empty_like(q)
    for i, context_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_pages = -(-context_len // k_cache.shape[1])
        table = block_tables[i, :num_pages]
        keys = _gather_pages(k_cache, table)[:context_len]  # [context_len, num_kv_heads, head_dim]
        values = _gather_pages(v_cache, table)[:context_len]
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)[:, None]  # [q_len, 1]
        kv_pos = torch.arange(context_len, device=q.device)[None, :]  # [1, context_len]
        visible = kv_pos <= q_pos  # [q_len, context_len]
        if sliding_window is not None:
            visible &= kv_pos > q_pos - sliding_window
        seq_out = _attend(
            q[start:end].float().transpose(0, 1)[None],  # [1, num_q_heads, q_len, head_dim]
            keys.float().transpose(0, 1)[None],  # [1, num_kv_heads, context_len, head_dim]
            values.float().transpose(0, 1)[None],
            visible,
            scale,
            softcap,
        )  # [1, num_q_heads, q_len, head_dim]
        out[start:end] = seq_out[0].transpose(0, 1).to(q.dtype)
    return out
