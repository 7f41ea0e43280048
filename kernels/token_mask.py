"""Token bitmask -> logits: tokens a grammar rules out get -inf, in place, on the constrained rows only.

    bitmask  int32 [num_masked, ceil(vocab / 32)]: bit (t % 32) of word t // 32 is 1 when token
             t is allowed (the layout llguidance and xgrammar fill); tokens past 32 * words
             are ruled out
    logits   float [num_rows, vocab]; rows[j] is the row that bitmask[j] constrains

Reference (bit by bit, float64) and kernel (unpack once, one select per row), and the check
that compares them (tests/kernels/test_token_mask.py).
"""

from __future__ import annotations

import numpy as np
import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:  # bool [num_masked, vocab_size]
    """Each row's allowed tokens as booleans."""
    words = bitmask.shape[1]
    if bitmask.device.type == "cpu":  # numpy's unpackbits: ~0.4 ms for 32 rows of Qwen2's 151,936 tokens
        count = min(vocab_size, 32 * words)
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, count=count, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], 32 * words)[:, :vocab_size]
    if allowed.shape[1] < vocab_size:
        pad = torch.zeros(allowed.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=allowed.device)
        allowed = torch.cat([allowed, pad], dim=1)
    return allowed


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[rows[j], t] = -inf wherever bitmask[j] rules token t out (in place)."""
    if len(rows) != bitmask.shape[0]:
        raise ValueError(f"{len(rows)} rows for {bitmask.shape[0]} bitmask rows")
    allowed = unpack_bitmask(bitmask, logits.shape[1]).to(logits.device, non_blocking=True)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = torch.where(allowed, logits[index], float("-inf"))


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The same, one bit at a time in float64 (returns a new tensor)."""
    out = logits.double().clone()
    words = bitmask.tolist()
    for j, row in enumerate(rows):
        for token in range(out.shape[1]):
            word = token // 32
            allowed = word < len(words[j]) and (words[j][word] >> (token % 32)) & 1
            if not allowed:
                out[row, token] = float("-inf")
    return out


def check(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Raise unless the kernel and the reference agree exactly on these inputs."""
    expected = apply_token_bitmask_reference(logits, bitmask, rows)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, rows)
    if not torch.equal(got.double(), expected):
        bad = (got.double() != expected).nonzero()[:5].tolist()
        raise AssertionError(f"token mask differs from the reference at {bad}")
