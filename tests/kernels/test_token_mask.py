"""kernels/token_mask.py against its bit-by-bit float64 reference."""

import pytest
import torch

from kernels.token_mask import apply_token_bitmask, check


@pytest.mark.parametrize("vocab, rows, masked", [(512, 4, [0, 2]), (100, 3, [1]), (32 * 7 + 5, 5, [4, 0, 3])])
def test_the_kernel_matches_the_reference(vocab, rows, masked):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=generator)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(masked), words), dtype=torch.int32, generator=generator)
    check(logits, bitmask, masked)


def test_unmasked_rows_are_untouched_and_a_short_bitmask_rules_out_the_rest():
    logits = torch.randn(3, 70)
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # allows tokens 0..63 only
    out = logits.clone()
    apply_token_bitmask(out, bitmask, [1])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.equal(out[1, :64], logits[1, :64]) and torch.isinf(out[1, 64:]).all()
    check(logits, bitmask, [1])


def test_rows_and_bitmask_must_agree():
    with pytest.raises(ValueError):
        apply_token_bitmask(torch.zeros(2, 32), torch.zeros(1, 1, dtype=torch.int32), [0, 1])
