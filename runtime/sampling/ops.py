"""The row-wise ops of sampling, on a batch of rows at once: each row's result is the same whatever else is in the
batch (every op here works along the last dimension only), so a seeded sequence's draws do not depend on it.

    penalise        repetition over prompt + output (HF style), then presence and frequency over output (OpenAI)
    filter_rows     top_k -> top_p -> min_p, each where a row asks for it (masked to -inf)
    tempered_probs  softmax(filter_rows(logits / temperature)): what a sampled token is drawn from
    draw_rows       inverse CDF: one uniform per row (drawn by the caller, in row order), float64 cumulative sums
"""

from __future__ import annotations

import torch


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
    """Mask (to -inf) the tokens that each row's top_k, top_p and min_p rule out."""
    vocab = logits.shape[1]
    k_rows = (top_k > 0) & (top_k < vocab)
    if bool(k_rows.any()):
        largest = torch.topk(logits, int(top_k[k_rows].max()), dim=1).values  # [rows, the largest k asked]
        kth = largest.gather(1, (top_k.clamp(1, largest.shape[1]) - 1)[:, None])  # [rows, 1]: the k-th largest
        logits = logits.masked_fill((logits < kth) & k_rows[:, None], float("-inf"))
    p_rows = top_p[:, 0] < 1.0
    if bool(p_rows.any()):
        sorted_logits, order = torch.sort(logits, dim=1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=1)
        mass_before = torch.cumsum(probs, dim=1) - probs  # probability of strictly better tokens
        drop_sorted = (mass_before >= top_p) & p_rows[:, None]
        drop_sorted[:, 0] = False  # the best token always stays (top_p=0 keeps only it)
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
    m_rows = min_p[:, 0] > 0.0
    if bool(m_rows.any()):
        probs = torch.softmax(logits, dim=1)
        below = probs < min_p * probs.max(dim=1, keepdim=True).values
        logits = logits.masked_fill(below & m_rows[:, None], float("-inf"))
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
