r"""Paged prefill attention in Triton: a ragged batch of query chunks in one launch.

Computes, for sequence i with q_len = query_start_loc[i+1] - query_start_loc[i] new tokens
and context_len = context_lens[i], the causal attention of each new token over the
sequence's cached pages plus the chunk itself (whose K/V write_kv already put in the pages):

    pages:  |  cached (prefix hit or earlier chunks)  |  this chunk  |
    query:                                             q0 q1 ... q_{n-1}
            q_j sits at position p = context_len - q_len + j and sees positions 0..p
            (p-W+1..p with a sliding window W)

Layouts:
    q, out            [num_tokens, num_q_heads, head_dim]   (last dim contiguous); the rows of
                      sequence i are query_start_loc[i] .. query_start_loc[i+1] - 1
    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables      int32 [num_seqs, max_blocks_per_seq]
    query_start_loc   int32 [num_seqs + 1]
    context_lens      int32 [num_seqs]; context_lens[i] >= q_len of sequence i

Grid: (query tiles, KV heads). A query tile is BLOCK_Q tokens of one sequence times the
`group` query heads that share the KV head, flattened into the rows of one tile
(row = token * GROUP_PAD + head), so each K/V page is read once per KV head and tile:

    rows:  t0h0 t0h1 .. t0h{G-1} | t1h0 t1h1 .. | ... | t{BLOCK_Q-1}h{G-1}

Sequence i's tiles are numbered from query_start_loc[i] // BLOCK_Q + i on, which leaves room
for its last partial tile and needs no host-side table; the grid covers
num_tokens // BLOCK_Q + num_seqs tiles and each program finds its sequence by counting the
sequences whose first tile is at or before its own. Programs past the end of their
sequence's chunk return at once.

Softmax and the weighted sum run in float32; the output comes back in the query's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_checks import (LOG2E, NO_WINDOW, check, check_attention_inputs, dot_operands, soft_cap,
                                    soft_cap_argument)

BLOCK_M = 64  # rows (tokens x query heads of a group) per query tile
TILE_N = 32  # K/V tokens per loop iteration
MASKED = tl.constexpr(-1.0e30)  # initial running max: finite, so a row with nothing visible yet stays NaN-free


@triton.jit
def _prefill_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    context_lens_ptr,  # int32 [num_seqs]
    scale_log2,  # scale * log2(e)
    window,  # sliding window in tokens (NO_WINDOW when none)
    cap_log2,  # soft-cap * log2(e), when SOFTCAP
    num_seqs,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_tables_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two of GROUP
    BLOCK_Q: tl.constexpr,  # tokens per query tile; BLOCK_Q * GROUP_PAD rows
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # a power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    TILE_N: tl.constexpr,  # K/V tokens per iteration
    SEQS_PAD: tl.constexpr,  # a power of two >= num_seqs
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,  # scores soft-capped (Gemma 2)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # which sequence this tile belongs to: the last one whose first tile is <= tile
    seq_ids = tl.arange(0, SEQS_PAD)
    seq_starts = tl.load(query_start_loc_ptr + seq_ids, mask=seq_ids < num_seqs, other=0)  # [SEQS_PAD]
    first_tiles = seq_starts // BLOCK_Q + seq_ids
    seq = tl.sum(((first_tiles <= tile) & (seq_ids < num_seqs)).to(tl.int32), 0) - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_token = (tile - q_start // BLOCK_Q - seq) * BLOCK_Q  # within the chunk
    if first_token >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tokens = first_token + rows // GROUP_PAD  # [BLOCK_M] index within the chunk
    heads = rows % GROUP_PAD
    row_mask = (tokens < q_len) & (heads < GROUP)
    positions = context_len - q_len + tokens  # [BLOCK_M] position of each row's token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q_heads = kv_head * GROUP + heads
    q_offsets = (q_start + tokens)[:, None] * stride_q_token + q_heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM_PAD]

    m = tl.full([BLOCK_Q * GROUP_PAD], MASKED, tl.float32)  # running max of the scores (log2 units)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    first_pos = context_len - q_len + first_token
    end = tl.minimum(first_pos + BLOCK_Q, context_len)  # one past the tile's last visible position
    lo = tl.maximum(first_pos - window + 1, 0)  # the tile's first visible position
    table = block_tables_ptr + seq * stride_tables_seq
    kv_tokens = tl.arange(0, TILE_N)
    for tile_start in range(lo - lo % TILE_N, end, TILE_N):
        kv_pos = tile_start + kv_tokens  # [TILE_N]
        kv_valid = (kv_pos >= lo) & (kv_pos < end)
        page = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)  # [TILE_N]
        slot_offsets = page * stride_cache_block + (kv_pos % BLOCK_SIZE) * stride_cache_slot
        slot_offsets += kv_head * stride_cache_head
        kv_offsets = slot_offsets[:, None] + dims[None, :]  # [TILE_N, HEAD_DIM_PAD]
        kv_mask = kv_valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [TILE_N, HEAD_DIM_PAD]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        if SOFTCAP:
            scores = soft_cap(scores, cap_log2)
        visible = (
            kv_valid[None, :]
            & (kv_pos[None, :] <= positions[:, None])
            & (kv_pos[None, :] > positions[:, None] - window)
        )
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, TILE_N]
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [TILE_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new

    l = tl.where(l > 0.0, l, 1.0)  # padding rows only: every real row sees at least itself
    out_offsets = (q_start + tokens)[:, None] * stride_out_token + q_heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=io_mask)


def _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, sliding_window, out):
    op = "paged_prefill_attention"
    check_attention_inputs(op, q, k_cache, v_cache, block_tables, context_lens, sliding_window, out,
                           query_start_loc=query_start_loc)
    num_seqs = context_lens.shape[0]
    check(op, query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,),
          f"query_start_loc must be int32 [{num_seqs + 1}], got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None = None,
    *,
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) before the softmax
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim]; allocated when None
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Triton paged prefill attention; same semantics as kernels.reference.paged_prefill_attention.

    One launch for the whole ragged batch; query_start_loc and context_lens stay on the
    device (no host sync). Raises ValueError on shapes, dtypes, devices or strides the
    kernel cannot take.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, sliding_window, out)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_tokens, num_q_heads, head_dim]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, BLOCK_M // group_pad)
    window = NO_WINDOW if sliding_window is None else int(sliding_window)
    dot_dtype, precision = dot_operands(q)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        float(scale) * LOG2E, window, soft_cap_argument("paged_prefill_attention", softcap), num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        SEQS_PAD=triton.next_power_of_2(num_seqs),
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        SOFTCAP=softcap is not None,
        num_warps=4,
    )
    return out


__all__ = ["paged_prefill_attention"]
