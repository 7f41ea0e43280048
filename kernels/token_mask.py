"""Token bitmasks -> the token ids a grammar allows next, per row.

    bitmask  int32 [rows, ceil(vocab / 32)]: bit (t % 32) of word t // 32 is 1 when token t
             is allowed (the layout llguidance and xgrammar fill); ids >= vocab_size are dropped

The sampler then works on the allowed ids alone (a gather of their logits), so a
constrained row costs O(allowed) after this call, where masking the row would cost O(vocab):
most JSON positions allow a handful of tokens. The kernel reads only the nonzero words
(a structural position has few), then their bits; a string's position, where most tokens
are allowed, costs one pass over the row's bits. All rows go through numpy together (a
batch of 32 is one set of calls, not 32). Reference (bit by bit) and kernel, and the
check that compares them (tests/kernels/test_token_mask.py).
"""

from __future__ import annotations

import numpy as np
import torch


def allowed_token_ids(bitmask: torch.Tensor, vocab_size: int) -> list[torch.Tensor]:  # per row: int64 [num_allowed]
    """Per bitmask row (int32 [rows, words], CPU), the ids whose bit is set, ascending; one pass for all rows."""
    words = bitmask.numpy().view(np.uint32).astype("<u4", copy=False)  # bytes in bit order on any host
    row, word = np.nonzero(words)  # row-major: rows ascending, words ascending within a row
    bits = np.unpackbits(words[row, word].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")  # [nonzero, 32]
    which, bit = np.nonzero(bits)
    ids = word[which].astype(np.int64) * 32 + bit
    rows = row[which]
    keep = ids < vocab_size
    ids, rows = ids[keep], rows[keep]
    bounds = np.searchsorted(rows, np.arange(1, words.shape[0]))
    return [torch.from_numpy(part) for part in np.split(ids, bounds)]


def allowed_token_ids_reference(bitmask: torch.Tensor, vocab_size: int) -> list[list[int]]:
    """The same, bit by bit."""
    return [[t for t in range(min(vocab_size, 32 * len(words))) if (words[t // 32] >> (t % 32)) & 1]
            for words in bitmask.tolist()]


def check(bitmask: torch.Tensor, vocab_size: int) -> None:
    """Raise unless the kernel and the reference give the same ids for these rows."""
    got = [ids.tolist() for ids in allowed_token_ids(bitmask, vocab_size)]
    expected = allowed_token_ids_reference(bitmask, vocab_size)
    if got != expected:
        raise AssertionError(f"allowed ids differ from the reference: {got[:8]}... vs {expected[:8]}...")
