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

With a sliding window W, query j sees only the W positions ending at its own: the call gathers
the pages from the chunk's first visible position on (not the whole context) and masks the
window's lower edge as well; a chunk that attends to a whole window of cached tokens is
therefore as cheap as one at the start of its sequence.
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
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of ragged query chunks over their cached pages plus themselves (within a window, if any)."""
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
        first_query = context_len - n  # the chunk's first position
        first_page = 0 if sliding_window is None else max(0, first_query - sliding_window + 1) // block_size
        first_key = first_page * block_size  # the first gathered position
        table = block_tables[i, first_page : -(-context_len // block_size)]
        keys = reference._gather_pages(k_cache, table)[: context_len - first_key]  # [keys, num_kv_heads, head_dim]
        values = reference._gather_pages(v_cache, table)[: context_len - first_key]
        mask = None
        if n < keys.shape[0] or sliding_window is not None:  # else q_len == k_len and causal says it all
            q_pos = torch.arange(first_query, context_len, device=q.device)[:, None]  # [n, 1]
            kv_pos = torch.arange(first_key, context_len, device=q.device)[None, :]  # [1, keys]
            mask = kv_pos <= q_pos  # [n, keys]
            if sliding_window is not None:
                mask &= kv_pos > q_pos - sliding_window
        seq_out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None],  # [1, num_q_heads, n, head_dim]
            keys.to(q.dtype).transpose(0, 1)[None],  # [1, num_kv_heads, keys, head_dim]
            values.to(q.dtype).transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=num_q_heads != num_kv_heads,
        )  # [1, num_q_heads, n, head_dim]
        out[start:end] = seq_out[0].transpose(0, 1)
    return out
