"""Token bitmask -> the token ids a grammar allows next, for one row.

    bitmask  int32 [ceil(vocab / 32)]: bit (t % 32) of word t // 32 is 1 when token t is
             allowed (the layout llguidance and xgrammar fill); ids >= vocab_size are dropped

The sampler then works on the allowed ids alone (a gather of their logits), so a
constrained row costs O(allowed) after this call, where masking the row would cost O(vocab):
most JSON positions allow a handful of tokens. The kernel reads only the nonzero words
(a structural position has few), then their bits; a string's position, where most tokens
are allowed, costs one pass over the row's bits. Reference (bit by bit) and kernel, and the
check that compares them (tests/kernels/test_token_mask.py).
"""

from __future__ import annotations

import numpy as np
import torch


def allowed_token_ids(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:  # int64 [num_allowed], ascending
    """The ids whose bit is set in one bitmask row (CPU, int32)."""
    words = bitmask.numpy().view(np.uint32)
    nonzero = np.flatnonzero(words)
    bits = np.unpackbits(words[nonzero].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")  # [nonzero, 32]
    word_index, bit = np.nonzero(bits)
    ids = nonzero[word_index].astype(np.int64) * 32 + bit
    return torch.from_numpy(ids[ids < vocab_size] if ids.size and ids[-1] >= vocab_size else ids)


def allowed_token_ids_reference(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    words = bitmask.tolist()
    return [t for t in range(min(vocab_size, 32 * len(words))) if (words[t // 32] >> (t % 32)) & 1]


def check(bitmask: torch.Tensor, vocab_size: int) -> None:
    """Raise unless the kernel and the reference give the same ids for this row."""
    got = allowed_token_ids(bitmask, vocab_size).tolist()
    expected = allowed_token_ids_reference(bitmask, vocab_size)
    if got != expected:
        raise AssertionError(f"allowed ids differ from the reference: {got[:8]}... vs {expected[:8]}...")
