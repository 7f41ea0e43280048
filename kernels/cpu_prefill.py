r"""The CPU's prefill attention: one flash call per chunk, in the activations' dtype.

A chunk with nothing cached before it (a fresh prompt, or its first chunk) attends causally
to itself with q_len == k_len, so torch's CPU flash kernel runs it with is_causal: the blocks
above the diagonal are skipped instead of masked, and no [q_len, context] mask is built
(1.7x faster at 2,048 tokens, BENCHMARKS.md section 16). A chunk after cached tokens (a
prefix hit, a later chunk) is one masked call over its whole context: splitting it into a
cached part and a causal part measured slower at the chunk sizes served here.

Unlike kernels/reference.py (the oracle, float32 throughout), q, K and V stay in the model's
dtype, as in transformers' own bf16 attention (the flash kernel accumulates in float32):
in bfloat16 that halves the bytes moved and drops a conversion of every gathered page.

Sliding windows go through kernels/reference.py for every chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import reference


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of ragged query chunks over their cached pages plus themselves (no window)."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    out = torch.empty_like(q)
    for i, context_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        n = end - start
        if n == 0:
            continue
        table = block_tables[i, : -(-context_len // block_size)]
        keys = reference._gather_pages(k_cache, table)[:context_len]  # [context_len, num_kv_heads, head_dim]
        values = reference._gather_pages(v_cache, table)[:context_len]
        mask = None
        if n < context_len:  # after cached tokens: query j (at position context_len - n + j) sees positions <= its own
            q_pos = torch.arange(context_len - n, context_len, device=q.device)[:, None]
            mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos  # [n, context_len]
        seq_out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None],  # [1, num_q_heads, n, head_dim]
            keys.to(q.dtype).transpose(0, 1)[None],  # [1, num_kv_heads, context_len, head_dim]
            values.to(q.dtype).transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=num_q_heads != num_kv_heads,
        )  # [1, num_q_heads, n, head_dim]
        out[start:end] = seq_out[0].transpose(0, 1)
    return out
