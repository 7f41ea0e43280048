"""Perplexity of an engine's model on a token sequence: exp of the mean negative log-likelihood.

The text runs through the model as prefill chunks over a fresh page table (the same paged
attention the engine serves with), and every position's logits score the next token.
Used to check that a quantized model predicts text as well as its float version.
"""

from __future__ import annotations

import math

import torch

from runtime.attention import AttentionMetadata


@torch.inference_mode()
def prefill_hidden(engine, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:  # [end - start, hidden]
    """The final hidden states of positions [start, end) of one sequence `ids` (int64 [n]), its K/V in the
    engine's first pages (page p holds positions p * block_size ..., so a slot is its position), the positions
    before `start` already computed by earlier calls. Call it on an idle engine."""
    runner = engine.runner
    device = runner.device
    positions = torch.arange(start, end, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions.clone(),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
        prefill_block_tables=torch.arange(-(-end // engine.block_size), dtype=torch.int32, device=device)[None],
        prefill_query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
        prefill_context_lens=torch.tensor([end], dtype=torch.int32, device=device),
        backend=runner.attention,
    )
    return runner.model(ids[start:end], positions, runner.layer_caches, meta)


@torch.inference_mode()
def perplexity(engine, token_ids: list[int], chunk: int = 512) -> float:
    """exp(mean -log p(token[i+1] | token[..i])) over the sequence, with `engine`'s model and KV pages.

    Takes the engine's first pages for the sequence: call it on an idle engine. Raises
    ValueError if the sequence needs more pages than the engine has, or has under 2 tokens.
    """
    runner = engine.runner
    block_size = engine.block_size
    num_pages = -(-len(token_ids) // block_size)
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    if num_pages > engine.num_blocks or len(token_ids) > engine.max_model_len:
        raise ValueError(f"{len(token_ids)} tokens need {num_pages} pages; the engine has {engine.num_blocks} "
                         f"(max_model_len {engine.max_model_len})")
    ids = torch.tensor(token_ids, dtype=torch.int64, device=runner.device)
    total, count = 0.0, 0
    for start in range(0, len(token_ids), chunk):
        end = min(start + chunk, len(token_ids))
        hidden = prefill_hidden(engine, ids, start, end)  # [end - start, hidden]
        targets = ids[start + 1 : end + 1]  # the next token of each row (the last row has none)
        logits = runner.model.compute_logits(hidden[: targets.shape[0]])  # float32 [rows, vocab]
        total -= torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum().item()
        count += targets.shape[0]
    return math.exp(total / count)
