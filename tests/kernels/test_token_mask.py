"""kernels/token_mask.py against its bit-by-bit reference."""

import pytest
import torch

from kernels.token_mask import allowed_token_ids, check


@pytest.mark.parametrize("vocab", [512, 100, 32 * 7 + 5, 151_936])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.5, 1.0])
def test_the_kernel_matches_the_reference(vocab, density):
    generator = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    bits = torch.rand(3, words * 32, generator=generator) < density  # [3, words * 32]
    bits[1] = False  # a row that allows nothing, between two that do
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    bitmask = (bits.view(3, words, 32).long() * weights).sum(dim=2).to(torch.uint32).view(torch.int32)
    check(bitmask, vocab)


def test_ids_past_the_vocabulary_are_dropped():
    bitmask = torch.tensor([[-1, -1]], dtype=torch.int32)  # 64 bits set
    assert [ids.tolist() for ids in allowed_token_ids(bitmask, 40)] == [list(range(40))]
    assert [ids.tolist() for ids in allowed_token_ids(torch.zeros(2, 3, dtype=torch.int32), 96)] == [[], []]
