r"""The rejection rule that makes speculation exact (Leviathan et al. 2023; Chen et al. 2023).

A draft token d was proposed with probability q(d); the target gives it p(d), where p is the
exact distribution the non-speculative sampler would draw from at that position (after
temperature, top-k/p, min-p, penalties, bias and the grammar mask). Then:

    accept d           with probability  min(1, p(d) / q(d))
    else draw from     norm(max(p - q, 0))          (the residual)

and whatever q was, the token that comes out is distributed as p. A deterministic draft (n-gram
lookup, a suffix index, a caller's prediction, a greedy draft model) has a one-hot q: accept
with probability p(d), else draw from p with d taken out. When all k drafts are accepted, the
target's row after the last one gives a bonus token, drawn from p as usual.

Greedy is the degenerate case: p is one-hot at the argmax, so a draft is kept exactly when it
is the argmax, and the token emitted is always the argmax: the stream cannot change.
"""

from __future__ import annotations

import torch


def accept_probability(p: torch.Tensor, q: torch.Tensor | None, draft: int) -> float:
    """min(1, p(d) / q(d)); `q` None means a deterministic draft (one-hot q). p, q: [vocab] probabilities."""
    target = float(p[draft])
    if q is None:
        return min(1.0, target)
    proposed = float(q[draft])
    if proposed <= 0.0:  # drawn from q, so q(d) > 0; a draft q never proposes is refused
        return 0.0
    return min(1.0, target / proposed)


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, draft: int) -> torch.Tensor:  # [vocab]
    """norm(max(p - q, 0)): what a rejection draws from. One-hot q: p with `draft` taken out.

    Where the residual has no mass (p == q, so rejection cannot happen), p itself is returned.
    """
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    if float(total) <= 0.0:
        return p
    return residual / total


def draw(probs: torch.Tensor, generator: torch.Generator, uniform: torch.Tensor | None = None) -> int:
    """One token from `probs` [vocab] by inverse CDF with one uniform draw (probability-0 tokens never come out);
    `uniform` (float64, 0-dim): that draw, made already by the caller from the same generator."""
    cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
    if uniform is None:
        uniform = torch.rand((), dtype=torch.float64, generator=generator)
    u = uniform * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


def verify_draft(p: torch.Tensor, q: torch.Tensor | None, draft: int, generator: torch.Generator) -> tuple[int, bool]:
    """(the token this position emits, whether it is the draft): one uniform draw, and one more on rejection."""
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    if u < accept_probability(p, q, draft):
        return draft, True
    return draw(residual_distribution(p, q, draft), generator), False
