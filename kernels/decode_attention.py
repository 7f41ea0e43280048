r"""Paged decode attention in Triton, flash-decoding style.

Computes, for each sequence i and query head h, the attention of the one new query token
(at position p = context_lens[i] - 1) over the K/V at positions 0..p held in the pages that
block_tables[i] lists (positions p-W+1..p with a sliding window W):

    out[i, h] = softmax(scale * q[i, h] . K[i, :, h // group]) @ V[i, :, h // group]

Layouts:
    q, out            [num_seqs, num_q_heads, head_dim]           (last dim contiguous)
    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables      int32 [num_seqs, max_blocks_per_seq]
    context_lens      int32 [num_seqs]; at least 1 each
    position t of sequence i lives at page block_tables[i, t // block_size], offset t % block_size

Two stages, so that one long sequence still spreads over the whole GPU:

    context:  | partition 0 | partition 1 | partition 2 | ... |    (partition_size tokens each)
    stage 1:  one program per (sequence, KV head, partition): the softmax-normalised partial
              output of the partition and its log-sum-exp, for every query head of the group
    stage 2:  one program per (sequence, query head): merges the partitions by log-sum-exp

GQA: the `group = num_q_heads // num_kv_heads` query heads sharing a KV head are the rows
of one [group, head_dim] query tile (padded to 16 rows for the tensor cores), so every page
is read once per KV head, not once per query head. Head dims that are not a power of two
(80, 96) are padded to the next one with masks. When the whole context fits in one
partition, stage 1 writes the output directly and stage 2 is skipped.

Softmax and the weighted sum run in float32 (exp2 with log2(e) folded into the scale);
the output comes back in the query's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_checks import (LOG2E, NO_WINDOW, check, check_attention_inputs, dot_operands, soft_cap,
                                    soft_cap_argument)

DEFAULT_PARTITION_SIZE = 512
MAX_TILE_N = 64  # K/V tokens per loop iteration
MERGE_TILE = 16  # partitions per loop iteration of the merge


@triton.jit
def _decode_partition_kernel(
    out_ptr,  # [num_seqs, num_q_heads, head_dim]; written when SINGLE_PARTITION
    part_out_ptr,  # float32 [num_seqs, num_q_heads, num_partitions, head_dim]
    part_lse_ptr,  # float32 [num_seqs, num_q_heads, num_partitions]; log2-sum-exp2 of the scores
    q_ptr,  # [num_seqs, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens_ptr,  # int32 [num_seqs]
    scale_log2,  # scale * log2(e)
    window,  # sliding window in tokens (NO_WINDOW when none)
    cap_log2,  # soft-cap * log2(e), when SOFTCAP
    num_partitions,
    stride_q_seq,
    stride_q_head,
    stride_out_seq,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_tables_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # rows of the query tile: a power of two >= max(GROUP, 16)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # a power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    TILE_N: tl.constexpr,  # K/V tokens per iteration; divides PARTITION_SIZE
    PARTITION_SIZE: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand dtype of tl.dot: the cache dtype, or float32 (see the launcher)
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,  # scores soft-capped (Gemma 2)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    first_visible = tl.maximum(context_len - window, 0)
    start = partition * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, context_len)
    if start >= context_len or start + PARTITION_SIZE <= first_visible:
        return  # nothing visible here; stage 2 knows which partitions hold anything

    rows = tl.arange(0, GROUP_PAD)  # [GROUP_PAD] query heads of this KV head
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q_heads = kv_head * GROUP + rows
    q_offsets = seq * stride_q_seq + q_heads[:, None] * stride_q_head + dims[None, :]  # [GROUP_PAD, HEAD_DIM_PAD]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    tokens = tl.arange(0, TILE_N)
    table = block_tables_ptr + seq * stride_tables_seq
    lo = tl.maximum(start, first_visible)
    for tile_start in range(lo - lo % TILE_N, end, TILE_N):
        pos = tile_start + tokens  # [TILE_N] positions in the sequence
        valid = (pos >= lo) & (pos < end)
        page = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)  # [TILE_N]
        slot_offsets = page * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head
        kv_offsets = slot_offsets[:, None] + dims[None, :]  # [TILE_N, HEAD_DIM_PAD]
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [TILE_N, HEAD_DIM_PAD]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [GROUP_PAD, TILE_N]
        if SOFTCAP:
            scores = soft_cap(scores, cap_log2)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])  # [GROUP_PAD, TILE_N]
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [TILE_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SINGLE_PARTITION:
        out_offsets = seq * stride_out_seq + q_heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_rows = (seq * tl.num_programs(1) * GROUP + q_heads) * num_partitions + partition  # [GROUP_PAD]
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], acc / l[:, None], mask=out_mask)
        tl.store(part_lse_ptr + part_rows, m + tl.log2(l), mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    out_ptr,  # [num_seqs, num_q_heads, head_dim]
    part_out_ptr,  # float32 [num_seqs, num_q_heads, num_partitions, head_dim]
    part_lse_ptr,  # float32 [num_seqs, num_q_heads, num_partitions]
    context_lens_ptr,  # int32 [num_seqs]
    window,
    num_partitions,
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    MERGE_TILE: tl.constexpr,  # partitions per iteration
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    first = tl.maximum(context_len - window, 0) // PARTITION_SIZE  # partitions stage 1 wrote
    last = (context_len - 1) // PARTITION_SIZE
    row = seq * tl.num_programs(1) + head
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    parts = tl.arange(0, MERGE_TILE)

    m = float("-inf")  # running max of the partitions' log-sum-exps
    total = 0.0  # running sum of exp2(lse - m)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for tile_start in range(first, last + 1, MERGE_TILE):
        part = tile_start + parts  # [MERGE_TILE]
        part_mask = part <= last
        lse = tl.load(part_lse_ptr + row * num_partitions + part, mask=part_mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        weight = tl.exp2(lse - m_new)  # [MERGE_TILE]; 0 for padding
        alpha = tl.exp2(m - m_new)
        partial = tl.load(
            part_out_ptr + (row * num_partitions + part)[:, None] * HEAD_DIM + dims[None, :],
            mask=part_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )  # [MERGE_TILE, HEAD_DIM_PAD]
        acc = acc * alpha + tl.sum(weight[:, None] * partial, 0)
        total = total * alpha + tl.sum(weight, 0)
        m = m_new
    out_offsets = seq * stride_out_seq + head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, (acc / total).to(out_ptr.dtype.element_ty), mask=dim_mask)


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, sliding_window, out, partition_size):
    op = "paged_decode_attention"
    if q.dim() == 3:  # one sequence per query row
        check(op, context_lens.shape == q.shape[:1],
              f"context_lens must be [num_seqs] = [{q.shape[0]}], got {tuple(context_lens.shape)}")
    check_attention_inputs(op, q, k_cache, v_cache, block_tables, context_lens, sliding_window, out)
    check(op, partition_size >= 16 and partition_size & (partition_size - 1) == 0,
          f"partition_size must be a power of two >= 16, got {partition_size}")


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None = None,
    *,
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) before the softmax
    out: torch.Tensor | None = None,  # [num_seqs, num_q_heads, head_dim]; allocated when None
    partition_size: int = DEFAULT_PARTITION_SIZE,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Triton paged decode attention; same semantics as kernels.reference.paged_decode_attention.

    The context of each sequence is split into partitions of `partition_size` tokens (a power
    of two >= 16) that run as separate programs and are merged by log-sum-exp. Raises
    ValueError on shapes, dtypes, devices or strides the kernel cannot take.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, sliding_window, out, partition_size)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [num_seqs, num_q_heads, head_dim]
    if num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    window = NO_WINDOW if sliding_window is None else int(sliding_window)
    # the widest context a block table can describe bounds the grid without reading context_lens
    num_partitions = triton.cdiv(block_tables.shape[1] * block_size, partition_size)
    single = num_partitions == 1
    if single:
        part_out = part_lse = out  # unused by the kernel
    else:
        part_out = torch.empty(num_seqs, num_q_heads, num_partitions, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_q_heads, num_partitions, dtype=torch.float32, device=q.device)
    dot_dtype, precision = dot_operands(q)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, part_out, part_lse, q, k_cache, v_cache, block_tables, context_lens,
        float(scale) * LOG2E, window, soft_cap_argument("paged_decode_attention", softcap), num_partitions,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=min(MAX_TILE_N, partition_size),
        PARTITION_SIZE=partition_size,
        SINGLE_PARTITION=single,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        SOFTCAP=softcap is not None,
        num_warps=4,
    )
    if not single:
        _decode_merge_kernel[(num_seqs, num_q_heads)](
            out, part_out, part_lse, context_lens, window, num_partitions, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            PARTITION_SIZE=partition_size,
            MERGE_TILE=MERGE_TILE,
            num_warps=4,
        )
    return out


__all__ = ["paged_decode_attention"]
