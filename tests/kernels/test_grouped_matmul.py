"""The grouped-weight matmul (kernels/grouped_matmul.py) equals its float64 reference up to float32
accumulation, in both of its loops and in its plain C++ build; the two loops agree bit for bit; one
wrong nibble or one wrong scale is far outside the bound; the unpack gives the reference's values bit
for bit; the torch path (no C++) agrees too.

Bound: the weights are the file's float32 values exactly (one fma per weight, checked by the unpack),
so the only error is float32 summation: K / 8 terms per lane then a tree of 8 lanes, each step rounded
to 2^-24 relative, so |out - ref| <= (K / 8 + 3) * 2^-24 * (|x| @ |W|.T) per output (5e-6 of that
magnitude at K = 576). A wrong nibble moves one product by a whole step of the table, a wrong scale
(a K-quant's 6-bit sc one off: 1/64) a whole group's 32 products: ~1e-3 of the magnitude and more.
"""

import pytest
import torch

from kernels import grouped_matmul



def test_the_kernel_builds():
    """The toolchain is part of the test setup (AVX2 or not: the portable loops build anywhere)."""
    assert grouped_matmul.available()

# (out, in, 4-bit codes, group, zero): 32-input groups on K = 576 / 192 (SmolLM2's widths, not multiples of
# 256), 16-input groups on K-quant widths; outputs not a multiple of the 8-output block
KINDS = [(37, 576, True, 32, True), (130, 192, True, 32, False), (37, 576, False, 32, True),
         (61, 192, False, 32, False), (45, 512, False, 16, False), (19, 1536, True, 32, True)]
ROWS = [1, 2, 3, 7, 8, 9, 17, 40]  # around the 8-row few-rows block, the 2-row tiles and the switch at 8


def _weight(out_features, in_features, four, group, zero, seed):
    gen = torch.Generator().manual_seed(seed)
    if four:
        codes = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=gen)
        table = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8)
    else:
        codes = torch.randint(-32, 32, (out_features, in_features), dtype=torch.int8, generator=gen)
        table = None
    groups = in_features // group
    # as ggml's: an f16 block scale times a small integer, an f16 zero
    scale = ((torch.rand(out_features, groups, generator=gen) + 0.5) * 1e-3).half().float() * torch.randint(
        1, 64, (out_features, groups), generator=gen).float()
    zero = (torch.randn(out_features, groups, generator=gen) * 0.01).half().float() if zero else None
    return codes, scale, zero, table


def _bound(in_features):
    return (in_features / 8 + 3) * 2**-24


def _error_ratio(out, x, weight):
    """max |out - ref| / (|x| @ |W|.T) over the outputs: within _bound(K) when correct."""
    ref = grouped_matmul.grouped_matmul_reference(x, *weight)
    magnitude = x.double().abs() @ grouped_matmul.grouped_values(*weight, dtype=torch.float64).abs().T
    assert out.shape == ref.shape and out.dtype == torch.float32
    return float(((out.double() - ref).abs() / magnitude).max())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "x".join(map(str, k)))
@pytest.mark.parametrize("loop", ["few", "many"])
def test_matches_the_float64_reference(kind, loop):
    weight = _weight(*kind, seed=kind[0] + kind[1])
    for rows in ROWS:
        x = torch.randn(rows, kind[1], generator=torch.Generator().manual_seed(rows))
        assert _error_ratio(grouped_matmul.grouped_matmul(x, *weight, loop=loop), x, weight) <= _bound(x.shape[1])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "x".join(map(str, k)))
def test_the_two_loops_and_any_row_split_agree_bit_for_bit(kind):
    weight = _weight(*kind, seed=3)
    x = torch.randn(40, kind[1])
    few = grouped_matmul.grouped_matmul(x, *weight, loop="few")
    assert torch.equal(grouped_matmul.grouped_matmul(x, *weight, loop="many"), few)
    for start, end in ((0, 1), (1, 4), (4, 13), (13, 40)):  # a prefix-cache hit: the last rows alone
        assert torch.equal(grouped_matmul.grouped_matmul(x[start:end], *weight), few[start:end])


def test_one_wrong_nibble_or_scale_fails_the_check():
    weight = _weight(37, 576, True, 32, True, seed=5)
    x = torch.randn(3, 576)
    out = grouped_matmul.grouped_matmul(x, *weight)
    assert _error_ratio(out, x, weight) <= _bound(x.shape[1])
    codes, scale, zero, table = weight
    nibble = codes.clone()
    nibble[20, 100] ^= 0x01  # one weight one table step off (the smallest step is 11 of 127)
    assert _error_ratio(grouped_matmul.grouped_matmul(x, nibble, scale, zero, table), x, weight) > 10 * _bound(576)
    scaled = scale.clone()
    scaled[11, 7] *= 64 / 63  # one group's scale one step of a 6-bit sc off
    assert _error_ratio(grouped_matmul.grouped_matmul(x, codes, scaled, zero, table), x, weight) > 10 * _bound(576)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "x".join(map(str, k)))
def test_unpack_gives_the_reference_values_bit_for_bit(kind):
    weight = _weight(*kind, seed=7)
    values = grouped_matmul.grouped_values(*weight)
    assert torch.equal(grouped_matmul.grouped_unpack(*weight, 0, kind[0]), values)
    assert torch.equal(grouped_matmul.grouped_unpack(*weight, 5, 17), values[5:17])


@pytest.mark.parametrize("kind", KINDS[:4], ids=lambda k: "x".join(map(str, k)))
def test_the_plain_cpp_build_agrees(kind):
    """Built without AVX2/FMA (-mno-avx2 -mno-fma): the portable loops, within the same bound."""
    assert grouped_matmul._extension(portable=True) is not None, "the plain build does not compile here"
    assert not grouped_matmul._extension(portable=True).vectorized()
    weight = _weight(*kind, seed=11)
    x = torch.randn(17, kind[1])
    few = grouped_matmul.grouped_matmul(x, *weight, loop="few", portable=True)
    assert torch.equal(grouped_matmul.grouped_matmul(x, *weight, loop="many", portable=True), few)
    assert _error_ratio(few, x, weight) <= _bound(x.shape[1])
    assert torch.equal(grouped_matmul.grouped_unpack(*weight, 0, kind[0], portable=True),
                       grouped_matmul.grouped_values(*weight))


@pytest.mark.parametrize("kind", KINDS[:4], ids=lambda k: "x".join(map(str, k)))
def test_the_torch_path_agrees(kind):
    weight = _weight(*kind, seed=13)
    x = torch.randn(9, kind[1])
    assert _error_ratio(grouped_matmul.grouped_matmul_torch(x, *weight), x, weight) <= _bound(x.shape[1])
