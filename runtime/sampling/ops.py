"""The row-wise ops of sampling, on a batch of rows at once: each row's result is the same whatever else is in the
batch (every op here works along the last dimension only), so a seeded sequence's draws do not depend on it.

    penalise        repetition over prompt + output (HF style), then presence and frequency over output (OpenAI)
    filter_rows     top_k -> top_p -> min_p, each where a row asks for it (masked to -inf); top_p ranks only a
                    row's best candidates (its top_k, or TOP_P_CANDIDATES), not a whole vocabulary
    tempered_probs  softmax(filter_rows(logits / temperature)): what a sampled token is drawn from
    draw_rows       inverse CDF: one uniform per row (drawn by the caller, in row order), float64 cumulative sums
"""

from __future__ import annotations

import torch

TOP_P_CANDIDATES = 1024  # a row without top_k ranks its best 1,024 tokens for top_p (all of them if they fall short)


def penalise(logits: torch.Tensor,  # float32 [rows, vocab]
             seen: torch.Tensor,  # bool [rows, vocab]: in the prompt or the output
             output_counts: torch.Tensor,  # float32 [rows, vocab]: times each token was generated
             repetition: torch.Tensor,  # float32 [rows, 1]
             presence: torch.Tensor,  # float32 [rows, 1]
             frequency: torch.Tensor) -> torch.Tensor:  # float32 [rows, 1]; returns float32 [rows, vocab], a new tensor
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    return logits - (frequency * output_counts + presence * (output_counts > 0).to(logits.dtype))


def filter_rows(logits: torch.Tensor,  # float32 [rows, vocab], tempered
                top_k: torch.Tensor,  # int64 [rows]; 0: off
                top_p: torch.Tensor,  # float32 [rows, 1]; 1: off
                min_p: torch.Tensor) -> torch.Tensor:  # float32 [rows, 1]; 0: off; returns [rows, vocab]
    """Mask (to -inf) the tokens that each row's top_k, top_p and min_p rule out (a row that does not ask for a
    filter is left as it is by that filter)."""
    vocab = logits.shape[1]
    ks = top_k.tolist()
    k_rows = [0 < k < vocab for k in ks]
    if any(k_rows):
        largest = torch.topk(logits, max(k for k, on in zip(ks, k_rows) if on), dim=1).values  # [rows, largest k]
        kth = largest[:, [min(k, largest.shape[1]) - 1 if on else 0 for k, on in zip(ks, k_rows)]].diagonal()[:, None]
        below = logits < kth  # [rows, vocab]: under the row's k-th largest value
        if not all(k_rows):
            below &= torch.tensor(k_rows)[:, None]
        logits = logits.masked_fill(below, float("-inf"))
    p_rows = [p < 1.0 for p in top_p[:, 0].tolist()]
    if any(p_rows):
        # the nucleus lies among each row's best few tokens (after top_k: among its k), so those are ranked,
        # not the whole vocabulary; a row whose best candidates do not reach its top_p ranks everything
        reach = [min(k, vocab) if on else TOP_P_CANDIDATES for k, on in zip(ks, k_rows)]
        num_candidates = min(vocab, max(r for r, asks in zip(reach, p_rows) if asks))
        probs = torch.softmax(logits, dim=1)  # [rows, vocab]
        best, order = torch.topk(probs, num_candidates, dim=1)  # [rows, candidates], best first
        mass = torch.cumsum(best, dim=1)
        if num_candidates < vocab and not bool((mass[:, -1:] >= top_p)[torch.tensor(p_rows)].all()):
            best, order = torch.sort(probs, dim=1, descending=True)  # a flat row: rank all of it
            mass = torch.cumsum(best, dim=1)
        keep = (mass - best) < top_p  # the probability of strictly better tokens is still below top_p
        keep[:, 0] = True  # the best token always stays (top_p=0 keeps only it)
        drop = torch.ones_like(probs, dtype=torch.bool).scatter(1, order, ~keep)
        if not all(p_rows):
            drop &= torch.tensor(p_rows)[:, None]
        logits = logits.masked_fill(drop, float("-inf"))
    m_rows = [m > 0.0 for m in min_p[:, 0].tolist()]
    if any(m_rows):
        probs = torch.softmax(logits, dim=1)
        below = probs < min_p * probs.max(dim=1, keepdim=True).values
        if not all(m_rows):
            below &= torch.tensor(m_rows)[:, None]
        logits = logits.masked_fill(below, float("-inf"))
    return logits


def tempered_probs(logits: torch.Tensor,  # float32 [rows, vocab]
                   temperature: torch.Tensor,  # float32 [rows, 1]
                   top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:  # [rows, vocab]
    return torch.softmax(filter_rows(logits / temperature, top_k, top_p, min_p), dim=1)


def draw_rows(probs: torch.Tensor,  # [rows, vocab]
              uniforms: torch.Tensor) -> list[int]:  # float64 [rows] in [0, 1)
    """One token per row by inverse CDF (a probability-0 token never comes out)."""
    cdf = torch.cumsum(probs, dim=1, dtype=torch.float64)
    targets = (uniforms * cdf[:, -1])[:, None]  # [rows, 1]
    chosen = torch.searchsorted(cdf, targets, right=True)[:, 0].clamp(max=probs.shape[1] - 1)
    return chosen.tolist()
