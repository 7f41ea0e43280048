"""The grouped-weight matmul (kernels/grouped_matmul.py) equals its float64 reference up to float32
accumulation, in the build this CPU makes (AVX-512 or AVX2) and the plain C++ one alike (to the bit); any split of the rows gives the same
bits; the activations round to int8 exactly as documented; one wrong nibble, scale or zero is far
outside the bound; the unpack gives the reference's values bit for bit; the torch path (no C++) agrees.

Bound: the weights are the file's float32 values exactly (checked by the unpack) and the activations
are their int8 blocks (q d, checked against the torch reference), so ref = (q d) @ W.T in float64 and
the only error is float32 arithmetic: per group one exact integer sum, its conversion to float (exact
below 2^24), one rounded scale product (dw d) and one fma into lane g mod 8, K / (8 G) fmas a lane, a
tree of 8 lanes, the zero terms' own lanes and tree, and their addition; a loose bound of it all:
|out - ref| <= (K / G + 6) * 2^-24 * (|q d| @ (|W - zero| + |zero|).T) per output
(1.4e-6 of that magnitude at K = 576). A wrong nibble moves one product by a whole step of the table, a
wrong scale (a K-quant's 6-bit sc one off: 1/64) a whole group's 32 products: ~1e-3 and more. Against x
unrounded, the rounding adds at most sum_k |W[n, k]| d(k) / 2, d(k) <= 2^-15 of its block's largest |x|.
"""

import pytest
import torch

from kernels import cpu_extension, grouped_matmul



def test_the_kernel_builds():
    """The toolchain is part of the test setup (AVX2 or not: the portable loops build anywhere)."""
    assert grouped_matmul.available()

# (out, in, codes, group, zero): 32-input groups on K = 576 / 192 (SmolLM2's widths, not multiples of
# 256), 16-input groups on K-quant widths; outputs not a multiple of 16: the row layout, the plain loop
# (PANEL_KINDS below take the vector loops). 4-bit codes
# through each kind of table the vector loop decodes its own way: IQ4_NL's (looked up), Q4_0's -8..7
# (the nibble, shifted) and Q4_1's / Q4_K's 0..15 (the nibble itself)
TABLES = {"iq4_nl": [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
          "q4_0": list(range(-8, 8)), "q4_1": list(range(16))}
KINDS = [(37, 576, "iq4_nl", 32, True), (130, 192, "iq4_nl", 32, False), (37, 576, "int8", 32, True),
         (61, 192, "int8", 32, False), (45, 512, "int8", 16, False), (19, 1536, "iq4_nl", 32, True),
         (37, 576, "q4_0", 32, False), (21, 192, "q4_0", 32, True), (37, 576, "q4_1", 32, True),
         (130, 192, "q4_1", 32, False)]
ROWS = [1, 2, 3, 7, 8, 9, 17, 40]  # blocks of 4 rows, then 2 and 1: every remainder


def _weight(out_features, in_features, code_kind, group, zero, seed):
    gen = torch.Generator().manual_seed(seed)
    if code_kind in TABLES:
        codes = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=gen)
        table = torch.tensor(TABLES[code_kind], dtype=torch.int8)
    else:
        codes = torch.randint(-32, 32, (out_features, in_features), dtype=torch.int8, generator=gen)
        table = None
    groups = in_features // group
    # as ggml's: an f16 block scale times a small integer, an f16 zero
    scale = ((torch.rand(out_features, groups, generator=gen) + 0.5) * 1e-3).half().float() * torch.randint(
        1, 64, (out_features, groups), generator=gen).float()
    zero = (torch.randn(out_features, groups, generator=gen) * 0.01).half().float() if zero else None
    return codes, scale, zero, table


def _bound(in_features, group):
    return (in_features / group + 6) * 2**-24


def _magnitude(x, weight, span=None):
    """float64 [M, N]: |xr| @ |q d|.T + |xr| @ |zero|.T, xr the activations as the kernel rounds them (blocks of
    `span` inputs: the weight's own by default)."""
    codes, scale, zero, table = weight
    group = x.shape[1] // scale.shape[1]
    rounded = grouped_matmul.rounded_activations(x, span or grouped_matmul.activation_span(*weight)).abs()
    values = grouped_matmul.grouped_values(codes, scale, None, table, dtype=torch.float64).abs()
    if zero is not None:
        values = values + zero.double().abs().repeat_interleave(group, dim=1)
    return rounded @ values.T


def _error_ratio(out, x, weight, span=None):
    """max |out - ref| / magnitude over the outputs, ref = (x rounded as the kernel does, in blocks of `span`:
    the weight's own by default) @ W.T in float64: within _bound(K, G) when correct."""
    span = span or grouped_matmul.activation_span(*weight)
    ref = grouped_matmul.rounded_activations(x, span) @ grouped_matmul.grouped_values(*weight, dtype=torch.float64).T
    assert out.shape == ref.shape and out.dtype == torch.float32
    return float(((out.double() - ref).abs() / _magnitude(x, weight, span)).max())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "x".join(map(str, k)))
def test_matches_the_float64_reference(kind):
    weight = _weight(*kind, seed=kind[0] + kind[1])
    for rows in ROWS:
        x = torch.randn(rows, kind[1], generator=torch.Generator().manual_seed(rows))
        assert _error_ratio(grouped_matmul.grouped_matmul(x, *weight), x, weight) <= _bound(kind[1], kind[3])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "x".join(map(str, k)))
def test_the_activations_round_as_documented(kind):
    """The kernel's int8 blocks equal the torch reference's bit for bit (ties to even included), and the
    whole result stays within the rounding's own bound of x @ W.T with x unrounded: sum |W| d / 2."""
    group = kind[3]
    gen = torch.Generator().manual_seed(19)
    x = torch.randn(13, kind[1], generator=gen) * torch.logspace(-3, 3, kind[1])  # blocks of very unlike sizes
    x[2, :group] = 0.0  # an all-zero block
    x[3, :group] = torch.linspace(-3e-37, 3e-38, group)  # too small for 127 / max|x| to be a float: zeros
    q, d = grouped_matmul.quantize_activations(x, group)
    ref_q, ref_d = grouped_matmul.activation_blocks_reference(x, group)
    assert torch.equal(q, ref_q) and torch.equal(d, ref_d)
    assert torch.equal(grouped_matmul.quantize_activations(x, group, portable=True)[0], q)
    assert (q[2, :group] == 0).all() and d[2, 0] == 0 and (q[3, :group] == 0).all() and d[3, 0] == 0
    ties = torch.tensor([[1.5, 2.5, -0.5] + [0.0] * (group - 4) + [127.0]])  # max 127: scaled = x exactly
    assert grouped_matmul.quantize_activations(ties, group)[0][0, :3].tolist() == [2, 2, 0]
    weight = _weight(*kind, seed=23)
    out = grouped_matmul.grouped_matmul(x, *weight).double()
    values = grouped_matmul.grouped_values(*weight, dtype=torch.float64)
    half_steps = (d.double() / 2).repeat_interleave(group, dim=1)  # [M, K]
    slack = half_steps @ values.abs().T + _bound(kind[1], group) * _magnitude(x, weight)
    assert ((out - x.double() @ values.T).abs() <= slack).all()


def test_a_nan_or_infinity_reaches_only_its_own_row():
    weight = _weight(37, 576, "iq4_nl", 32, True, seed=29)
    x = torch.randn(4, 576)
    x[1, 100] = float("nan")
    x[2, 7] = float("inf")
    out = grouped_matmul.grouped_matmul(x, *weight)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert torch.equal(out[[0, 3]], grouped_matmul.grouped_matmul(x[[0, 3]], *weight))
    assert torch.equal(grouped_matmul.grouped_matmul(torch.zeros(2, 576), *weight), torch.zeros(2, 37))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "x".join(map(str, k)))
def test_any_row_split_agrees_bit_for_bit(kind):
    weight = _weight(*kind, seed=3)
    x = torch.randn(40, kind[1])
    whole = grouped_matmul.grouped_matmul(x, *weight)
    for start, end in ((0, 1), (1, 4), (4, 13), (13, 40), (5, 6)):  # a prefix-cache hit: the last rows alone
        assert torch.equal(grouped_matmul.grouped_matmul(x[start:end], *weight), whole[start:end])
    # rows past one L2 chunk (kRowChunkBytes / (2 K) rows) split at a chunk's edge too
    many = torch.randn(300, kind[1])
    whole = grouped_matmul.grouped_matmul(many, *weight)
    assert torch.equal(grouped_matmul.grouped_matmul(many[250:], *weight), whole[250:])


@pytest.mark.parametrize("code_kind", ["iq4_nl", "q4_0", "q4_1"])
def test_one_wrong_nibble_or_scale_fails_the_check(code_kind):
    weight = _weight(37, 576, code_kind, 32, True, seed=5)
    x = torch.randn(3, 576)
    out = grouped_matmul.grouped_matmul(x, *weight)
    assert _error_ratio(out, x, weight) <= _bound(576, 32)
    codes, scale, zero, table = weight
    nibble = codes.clone()
    nibble[20, 100] ^= 0x01  # one weight one table step off (IQ4_NL's smallest step is 11 of 127; the others' 1)
    assert _error_ratio(grouped_matmul.grouped_matmul(x, nibble, scale, zero, table), x, weight) > 10 * _bound(576, 32)
    scaled = scale.clone()
    scaled[11, 7] *= 64 / 63  # one group's scale one step of a 6-bit sc off
    assert _error_ratio(grouped_matmul.grouped_matmul(x, codes, scaled, zero, table), x, weight) > 10 * _bound(576, 32)
    shifted = zero.clone()
    shifted[30, 3] += 0.01  # one group's zero off by a typical zero's size
    assert _error_ratio(grouped_matmul.grouped_matmul(x, codes, scale, shifted, table), x, weight) > 10 * _bound(576, 32)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "x".join(map(str, k)))
def test_unpack_gives_the_reference_values_bit_for_bit(kind):
    weight = _weight(*kind, seed=7)
    values = grouped_matmul.grouped_values(*weight)
    assert torch.equal(grouped_matmul.grouped_unpack(*weight, 0, kind[0]), values)
    assert torch.equal(grouped_matmul.grouped_unpack(*weight, 5, 17), values[5:17])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "x".join(map(str, k)))
def test_the_plain_cpp_build_gives_the_same_bits(kind):
    """Built without AVX2/FMA (-mno-avx2 -mno-fma): the portable loops compute the same lanes in the same
    order, so their result is the AVX2 build's to the bit (where this CPU has AVX2; else both are plain)."""
    assert grouped_matmul._extension(portable=True) is not None, "the plain build does not compile here"
    assert not grouped_matmul._extension(portable=True).vectorized()
    weight = _weight(*kind, seed=11)
    x = torch.randn(17, kind[1])
    plain = grouped_matmul.grouped_matmul(x, *weight, portable=True)
    assert torch.equal(plain, grouped_matmul.grouped_matmul(x, *weight))
    assert _error_ratio(plain, x, weight) <= _bound(kind[1], kind[3])
    assert torch.equal(grouped_matmul.quantize_activations(x, kind[3], portable=True)[0],
                       grouped_matmul.activation_blocks_reference(x, kind[3])[0])
    assert torch.equal(grouped_matmul.grouped_unpack(*weight, 0, kind[0], portable=True),
                       grouped_matmul.grouped_values(*weight))


@pytest.mark.parametrize("kind", KINDS[:4], ids=lambda k: "x".join(map(str, k)))
def test_the_torch_path_agrees(kind):
    weight = _weight(*kind, seed=13)
    x = torch.randn(9, kind[1])
    # torch's matmul on x unrounded: float32 summation only, K / 8 terms a lane then a tree of 8
    ref = grouped_matmul.grouped_matmul_reference(x, *weight)
    magnitude = x.double().abs() @ grouped_matmul.grouped_values(*weight, dtype=torch.float64).abs().T
    assert float(((grouped_matmul.grouped_matmul_torch(x, *weight).double() - ref).abs() / magnitude).max()) <= \
        (kind[1] / 8 + 3) * 2**-24


# every kind of KINDS again with a multiple of 16 outputs (the panel layout; KINDS' are not: the row loops)
PANEL_KINDS = [(48, 576, "iq4_nl", 32, True), (144, 192, "q4_0", 32, False), (48, 576, "int8", 32, True),
               (32, 512, "int8", 16, False), (48, 576, "q4_1", 32, True), (64, 192, "q4_0", 32, True)]


def _assert_the_same_bits_at_every_row_count(layout, twin, weight, kind, seed):
    """`layout` gives `twin`'s bits for every row count of ROWS, in both builds, within the bound of `weight`."""
    for rows in ROWS:
        x = torch.randn(rows, kind[1], generator=torch.Generator().manual_seed(rows + seed))
        out = grouped_matmul.grouped_matmul(x, *layout)
        assert torch.equal(out, grouped_matmul.grouped_matmul(x, *twin))
        assert torch.equal(grouped_matmul.grouped_matmul(x, *layout, portable=True), out)
        assert _error_ratio(out, x, weight) <= _bound(kind[1], kind[3])


@pytest.mark.parametrize("kind", PANEL_KINDS, ids=lambda k: "x".join(map(str, k)))
def test_the_panel_layout_gives_the_row_layouts_bits(kind):
    """The same bytes with 16 outputs' groups interleaved (one vector of outputs a load): any row count
    gives the row layout's bits, in both builds; the layout converts both ways; rows are picked from it."""
    codes, scale, zero, table = weight = _weight(*kind, seed=31)
    panel_codes, panel_scale, panel_zero = grouped_matmul.to_panels(codes, scale, zero)
    panels = (panel_codes, panel_scale, panel_zero, table)
    back = grouped_matmul.to_rows(panel_codes, panel_scale, panel_zero)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scale)
    assert (back[2] is None) if zero is None else torch.equal(back[2], zero)
    ids = torch.tensor([kind[0] - 1, 0, 5, 17, 5])
    picked = grouped_matmul.select_rows(panel_codes, panel_scale, panel_zero, ids)
    assert torch.equal(picked[0], codes[ids]) and torch.equal(picked[1], scale[ids])
    assert (picked[2] is None) if zero is None else torch.equal(picked[2], zero[ids])
    _assert_the_same_bits_at_every_row_count(panels, weight, weight, kind, seed=1)
    assert torch.equal(grouped_matmul.grouped_unpack(*panels, 3, kind[0] - 2), grouped_matmul.grouped_values(*weight)[3:-2])
    for layout in (panels, weight):  # rows by id: each id's values, both builds
        assert torch.equal(grouped_matmul.grouped_rows(*layout, ids), grouped_matmul.grouped_values(*weight)[ids])
        assert torch.equal(grouped_matmul.grouped_rows(*layout, ids, portable=True), grouped_matmul.grouped_values(*weight)[ids])
    assert grouped_matmul.grouped_rows(*panels, ids[:0]).shape == (0, kind[1])
    with pytest.raises(RuntimeError, match="out of"):
        grouped_matmul.grouped_rows(*panels, torch.tensor([kind[0]]))
    assert torch.equal(grouped_matmul.grouped_values(*panels), grouped_matmul.grouped_values(*weight))
    x = torch.randn(3, kind[1])
    assert torch.equal(grouped_matmul.grouped_matmul_torch(x, *panels), grouped_matmul.grouped_matmul_torch(x, *weight))


@pytest.mark.parametrize("code_kind", ["q4_0", "int8"])
def test_a_wrong_code_in_the_panel_layout_fails_the_check(code_kind):
    codes, scale, zero, table = weight = _weight(48, 576, code_kind, 32, False, seed=37)
    panel_codes, panel_scale, _ = grouped_matmul.to_panels(codes, scale, zero)
    for rows in (1, 9):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        assert _error_ratio(grouped_matmul.grouped_matmul(x, panel_codes, panel_scale, zero, table), x, weight) <= \
            _bound(576, 32)
        wrong = panel_codes.clone()
        wrong.view(torch.uint8)[0, 5, 39] ^= 0x10  # load 0, byte 16c + 2t + 1 with c = 2, t = 3: output 11's
        moved = (grouped_matmul.to_rows(wrong, panel_scale)[0] != codes).nonzero()
        assert moved[:, 0].tolist() == [11] and 5 * codes.shape[1] // 18 <= moved[0, 1] < 6 * codes.shape[1] // 18
        assert _error_ratio(grouped_matmul.grouped_matmul(x, wrong, panel_scale, zero, table), x, weight) > \
            10 * _bound(576, 32)


def _factored(out_features, in_features, code_kind, group, zero, per_unit, seed):
    """A weight whose scales (and zeros) are factored as the K-quants store them, and its float32 twin:
    ((codes, Factored scale, Factored zero or None, table), (codes, float scale, float zero or None, table))."""
    gen = torch.Generator().manual_seed(seed)
    codes, _, _, table = _weight(out_features, in_features, code_kind, group, False, seed)
    groups = in_features // group
    units = ((torch.rand(out_features, groups // per_unit, generator=gen) + 0.5) * 1e-3).half().float()
    scale = grouped_matmul.factor(torch.randint(-64, 64, (out_features, groups), generator=gen), units)  # Q6_K's sc
    zeros = None
    if zero:  # Q4_K's: -(dmin * m), m in 0..63
        zero_units = -((torch.rand(out_features, groups // per_unit, generator=gen) + 0.5) * 1e-3).half().float()
        zeros = grouped_matmul.factor(torch.randint(0, 64, (out_features, groups), generator=gen), zero_units)
    return (codes, scale, zeros, table), (codes, scale.floats(), None if zeros is None else zeros.floats(), table)


# (out, in, codes, group, zero, groups per unit): Q4_K's shape (units per 8 groups of 32), Q6_K's (16 of 16),
# a multiple of 16 outputs (the panel layout) and not
FACTORED_KINDS = [(48, 512, "q4_1", 32, True, 8), (37, 512, "q4_1", 32, True, 8), (32, 1536, "int8", 16, False, 16),
                  (44, 256, "iq4_nl", 32, False, 8), (36, 512, "int8", 16, True, 16), (12, 768, "q4_0", 32, True, 24)]


@pytest.mark.parametrize("kind", FACTORED_KINDS, ids=lambda k: "x".join(map(str, k)))
def test_factored_scales_take_the_unit_arithmetic_in_every_form(kind):
    """int8 scales and zeros times a unit per run of groups, the unit float32 or (narrowed, as a file's f16 d)
    float16: the values are the float form's (the product is exact: the unpack, the torch path); the kernel rounds
    the activations per unit span (Q4_K's and Q6_K's 256) and sums each unit's groups in int32 before one float
    step, and every loop (one row, row blocks, the panel layout, the plain build) gives the same bits, within the
    float64 bound of (x rounded per span) @ W.T, and not the per-group form's arithmetic."""
    factored, floats = _factored(*kind, seed=41)
    span = kind[3] * kind[5]
    assert grouped_matmul.activation_span(*factored) == span and grouped_matmul.activation_span(*floats) == kind[3]
    half = (factored[0], grouped_matmul.narrowed(factored[1]), grouped_matmul.narrowed(factored[2]), factored[3])
    assert half[1].units.dtype == torch.float16 and half[1].nbytes() < factored[1].nbytes()
    forms = [factored, half]
    if kind[0] % grouped_matmul.PANEL == 0:
        forms += [(*grouped_matmul.to_panels(*form[:3]), form[3]) for form in (factored, half)]
    for rows in (1, 2, 5, 9, 17):
        x = torch.randn(rows, kind[1], generator=torch.Generator().manual_seed(rows + 2))
        out = grouped_matmul.grouped_matmul(x, *factored)
        for weight in forms:
            assert torch.equal(grouped_matmul.grouped_matmul(x, *weight), out)
            assert torch.equal(grouped_matmul.grouped_matmul(x, *weight, portable=True), out)
        assert _error_ratio(out, x, floats, span) <= _bound(kind[1], kind[3])
        assert _error_ratio(grouped_matmul.grouped_matmul(x, *floats), x, floats, span) > 10 * _bound(kind[1], kind[3])
    for weight in forms:
        assert torch.equal(grouped_matmul.grouped_values(*weight), grouped_matmul.grouped_values(*floats))
        assert torch.equal(grouped_matmul.grouped_unpack(*weight, 1, kind[0]), grouped_matmul.grouped_values(*floats)[1:])
        x = torch.randn(3, kind[1])
        assert torch.equal(grouped_matmul.grouped_matmul_torch(x, *weight), grouped_matmul.grouped_matmul_torch(x, *floats))
    ids = [3, 0, kind[0] - 1, 3]
    picked = grouped_matmul.select_rows(*forms[-1][:3], torch.tensor(ids))
    assert torch.equal(picked[1].floats(), floats[1][ids])
    assert (picked[2] is None) if floats[2] is None else torch.equal(picked[2].floats(), floats[2][ids])


def test_a_unit_sum_at_its_largest_stays_exact():
    """The unit arithmetic's int32 sum at its limit: 1024 inputs (32 groups of 32) of code -128, int -128, q 127,
    2^31 - 2^24 in all, stays within the float64 bound in both builds (an overflow would flip its sign); a span
    past 1024 takes the per-group arithmetic."""
    codes = torch.full((16, 1024), -128, dtype=torch.int8)
    scale = grouped_matmul.factor(torch.full((16, 32), -128), torch.full((16, 1), 2.0**-10))
    zero = grouped_matmul.factor(torch.full((16, 32), -128), torch.full((16, 1), 2.0**-12))
    x = torch.full((2, 1024), 3.0)
    for weight in ((codes, scale, zero, None), (*grouped_matmul.to_panels(codes, scale, zero), None)):
        assert grouped_matmul.activation_span(*weight) == 1024
        out = grouped_matmul.grouped_matmul(x, *weight)
        twin = (codes, scale.floats(), zero.floats(), None)
        assert _error_ratio(out, x, twin, 1024) <= _bound(1024, 32) and float(out[0, 0]) > 49000  # 1024 * 3 * 15.97
        assert torch.equal(grouped_matmul.grouped_matmul(x, *weight, portable=True), out)
    wide = grouped_matmul.factor(torch.full((16, 64), 1), torch.ones(16, 1))
    assert grouped_matmul.activation_span(torch.zeros(16, 2048, dtype=torch.int8), wide, None, None) == 32


# the vector builds this CPU does not make by itself, built on purpose (tests/kernels/prebuild.py builds them beforehand)
OTHER_BUILDS = {"avx2": ("-mno-avx512f",), "avx512-without-vnni": ("-mno-avx512vnni",)}


@pytest.mark.parametrize("flags", list(OTHER_BUILDS.values()), ids=list(OTHER_BUILDS))
def test_the_other_builds_give_the_same_bits(flags):
    """The AVX2 loops (8 outputs a vector, a panel in two halves), built with AVX-512 turned off, and the AVX-512
    loops without VNNI (vpmaddubsw: signed codes as their magnitudes against the inputs signed by them), against the
    build this CPU makes and the plain one: panels of 4-, 6- and 8-bit codes (the whole int8 range too), float32,
    float16 and factored scales (float32 and float16 units). (On a CPU without AVX-512 the second is this CPU's
    own build.)"""
    other = cpu_extension.load("grouped_matmul.cpp", flags)
    factored, _ = _factored(48, 512, "q4_1", 32, True, 8, seed=61)
    weights = [(*grouped_matmul.to_panels(*factored[:3]), factored[3])]
    weights.append((*grouped_matmul.to_panels(factored[0], *(grouped_matmul.narrowed(s) for s in factored[1:3])),
                    factored[3]))
    gen = torch.Generator().manual_seed(64)
    full = torch.randint(-128, 128, (32, 512), dtype=torch.int8, generator=gen)
    full[0] = -128  # the code whose magnitude is no int8
    weights.append((*grouped_matmul.to_panels(full, torch.rand(32, 16, generator=gen) * 1e-2, None), None))
    for kind in SIX_KINDS:
        codes, scale, zero, _ = _weight(*kind, seed=62)
        weights.append((*grouped_matmul.to_panels(codes, scale, zero, bits=6), None))
    for kind in PANEL_KINDS:
        codes, scale, zero, table = _weight(*kind, seed=63)
        scale, zero = scale.half().float(), None if zero is None else zero.half().float()
        weights.append((*grouped_matmul.to_panels(codes, scale, zero), table))
        weights.append((*grouped_matmul.to_panels(codes, grouped_matmul.narrowed(scale), grouped_matmul.narrowed(zero)),
                        table))
    for weight in weights:
        for rows in (1, 3, 6, 9):
            x = torch.randn(rows, _shape_of(weight)[1], generator=torch.Generator().manual_seed(rows + 7))
            out = other.grouped_matmul(x, *grouped_matmul.kernel_arguments(*weight))
            assert torch.equal(out, grouped_matmul.grouped_matmul(x, *weight))
            assert torch.equal(out, grouped_matmul.grouped_matmul(x, *weight, portable=True))


def _shape_of(weight) -> tuple[int, int]:  # (N, K) of a panel-layout weight
    codes, scale = weight[0], weight[1]
    per_group = codes.shape[2] // grouped_matmul.PANEL  # bytes of one output's group
    group = per_group * 4 // 3 if grouped_matmul.six_bit(codes) else 32 if codes.dtype == torch.uint8 else per_group
    return codes.shape[0] * grouped_matmul.PANEL, codes.shape[1] * group


HALF_KINDS = [(48, 576, "q4_1", 32, True), (37, 576, "q4_0", 32, False), (32, 512, "int8", 16, False),
              (61, 192, "int8", 32, True)]


@pytest.mark.parametrize("kind", HALF_KINDS, ids=lambda k: "x".join(map(str, k)))
def test_float16_scales_give_the_float_scales_bits(kind):
    """Scales and zeros that float16 holds exactly (a file's own f16) kept as float16: the same floats, so every
    loop (rows or panels, any row count, both builds, the unpack, the torch path, picked rows) gives the
    float32 form's bits."""
    codes, scale, zero, table = _weight(*kind, seed=51)
    scale, zero = scale.half().float(), None if zero is None else zero.half().float()
    halves = (grouped_matmul.narrowed(scale), grouped_matmul.narrowed(zero))
    assert halves[0].dtype == torch.float16 and (zero is None or halves[1].dtype == torch.float16)
    layouts = [((codes, scale, zero, table), (codes, *halves, table))]
    if kind[0] % grouped_matmul.PANEL == 0:
        layouts.append(((*grouped_matmul.to_panels(codes, scale, zero), table),
                        (*grouped_matmul.to_panels(codes, *halves), table)))
    for floats, half in layouts:
        for rows in (1, 2, 5, 9, 17):
            x = torch.randn(rows, kind[1], generator=torch.Generator().manual_seed(rows + 5))
            out = grouped_matmul.grouped_matmul(x, *floats)
            assert torch.equal(grouped_matmul.grouped_matmul(x, *half), out)
            assert torch.equal(grouped_matmul.grouped_matmul(x, *half, portable=True), out)
        assert torch.equal(grouped_matmul.grouped_unpack(*half, 1, kind[0]), grouped_matmul.grouped_values(*floats)[1:])
        x = torch.randn(3, kind[1])
        assert torch.equal(grouped_matmul.grouped_matmul_torch(x, *half), grouped_matmul.grouped_matmul_torch(x, *floats))
        picked = grouped_matmul.select_rows(*half[:3], torch.tensor([kind[0] - 1, 2]))
        assert torch.equal(picked[1].float(), scale[[kind[0] - 1, 2]])
        assert (picked[2] is None) if zero is None else torch.equal(picked[2].float(), zero[[kind[0] - 1, 2]])
        assert grouped_matmul.select_rows(*half[:3], torch.tensor([], dtype=torch.int64))[0].shape[0] == 0


@pytest.mark.parametrize("inexact", [0.1, 2.0**-25, 65520.0, 1e-8])
def test_only_exact_float16_scales_are_narrowed(inexact):
    scale = torch.tensor([[0.5, inexact]], dtype=torch.float32)  # one value float16 cannot hold keeps float32
    assert grouped_matmul.narrowed(scale) is scale
    exact = torch.tensor([[0.5, 2.0**-14, 2.0**-24, 65504.0]])  # subnormals and the largest finite included
    assert grouped_matmul.narrowed(exact).dtype == torch.float16
    with pytest.raises(RuntimeError, match="float32, float16, or int8"):
        codes, scale, _, table = _weight(16, 64, "q4_0", 32, False, seed=1)
        grouped_matmul.grouped_matmul(torch.randn(1, 64), codes, scale.double(), None, table)


def test_one_wrong_factored_int_or_unit_fails_the_check():
    (codes, scale, zero, table), floats = _factored(48, 512, "q4_1", 32, True, 8, seed=43)
    panel_codes, panel_scale, panel_zero = grouped_matmul.to_panels(codes, scale, zero)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(47))
    assert _error_ratio(grouped_matmul.grouped_matmul(x, panel_codes, panel_scale, panel_zero, table), x, floats, 256) <= \
        _bound(512, 32)
    ints = panel_scale.ints.clone()
    ints[0, 5, 11] += 1  # output 11's group 5: its sc one step off
    wrong = grouped_matmul.Factored(ints, panel_scale.units)
    assert _error_ratio(grouped_matmul.grouped_matmul(x, panel_codes, wrong, panel_zero, table), x, floats, 256) > \
        10 * _bound(512, 32)
    units = panel_zero.units.clone()
    units[1, 1, 7] *= 1.125  # output 23's second unit of zeros (dmin) off by an eighth
    wrong = grouped_matmul.Factored(panel_zero.ints, units)
    assert _error_ratio(grouped_matmul.grouped_matmul(x, panel_codes, panel_scale, wrong, table), x, floats, 256) > \
        10 * _bound(512, 32)


def test_factored_scales_need_units_of_whole_runs_of_8_groups():
    with pytest.raises(ValueError, match="one per 8k groups"):
        grouped_matmul.factor(torch.zeros(4, 12, dtype=torch.int8), torch.ones(4, 3))  # runs of 4 groups
    codes, scale, zero, table = _weight(8, 512, "q4_1", 32, False, seed=1)
    bad = grouped_matmul.Factored(torch.zeros(8, 16, dtype=torch.int8), torch.ones(8, 4))  # runs of 4, unchecked
    with pytest.raises(RuntimeError, match="one per 8k groups"):
        grouped_matmul.grouped_matmul(torch.randn(1, 512), codes, bad, None, table)


# 8-bit codes in [-32, 31] (Q6_K's q - 32 per 16, Q5_x's per 32) kept in 6 bits: (out, in, "int8", group, zero)
SIX_KINDS = [(48, 576, "int8", 32, True), (32, 512, "int8", 16, False), (64, 256, "int8", 16, True),
             (16, 64, "int8", 32, False)]


@pytest.mark.parametrize("kind", SIX_KINDS, ids=lambda k: "x".join(map(str, k)))
def test_six_bit_panels_give_the_eight_bit_bits(kind):
    """The same integers in 6 bits (the nibbles' layout and 2 high bits an input): every row count gives the 8-bit
    panels' bits, in both builds, factored scales too; the row layout comes back as the 8-bit codes."""
    codes, scale, zero, _ = weight = _weight(*kind, seed=71)
    eight = (*grouped_matmul.to_panels(codes, scale, zero), None)
    six = (*grouped_matmul.to_panels(codes, scale, zero, bits=6), None)
    assert grouped_matmul.six_bit(six[0]) and not grouped_matmul.six_bit(eight[0])
    assert six[0].numel() * 4 == eight[0].numel() * 3  # 6 bits an input, not 8
    assert torch.equal(grouped_matmul.to_rows(*six[:3])[0], codes)
    ids = torch.tensor([kind[0] - 1, 0, 5, 11, 5])
    assert torch.equal(grouped_matmul.select_rows(*six[:3], ids)[0], codes[ids])
    groups = kind[1] // kind[3]  # Q6_K's factored scales: int8 times a unit per 8 groups (where they divide)
    factored_pairs = []  # (6-bit, 8-bit) panels with factored scales
    if groups % 8 == 0:
        factored = grouped_matmul.factor(torch.randint(-64, 64, scale.shape), torch.rand(kind[0], groups // 8) + 0.5)
        factored_pairs.append(((*grouped_matmul.to_panels(codes, factored, None, bits=6), None),
                               (*grouped_matmul.to_panels(codes, factored, None), None)))
    _assert_the_same_bits_at_every_row_count(six, eight, weight, kind, seed=3)
    for six_factored, eight_factored in factored_pairs:
        for rows in ROWS:
            x = torch.randn(rows, kind[1], generator=torch.Generator().manual_seed(rows + 5))
            assert torch.equal(grouped_matmul.grouped_matmul(x, *six_factored),
                               grouped_matmul.grouped_matmul(x, *eight_factored))
    assert torch.equal(grouped_matmul.grouped_unpack(*six, 1, kind[0]), grouped_matmul.grouped_values(*weight)[1:])
    assert torch.equal(grouped_matmul.grouped_rows(*six, ids), grouped_matmul.grouped_values(*weight)[ids])
    assert torch.equal(grouped_matmul.grouped_rows(*six, ids, portable=True), grouped_matmul.grouped_values(*weight)[ids])
    x = torch.randn(3, kind[1])
    assert torch.equal(grouped_matmul.grouped_matmul_torch(x, *six), grouped_matmul.grouped_matmul_torch(x, *weight))


def test_a_wrong_high_bit_in_six_bit_panels_fails_the_check():
    codes, scale, zero, _ = weight = _weight(32, 512, "int8", 16, False, seed=73)
    panel_codes, panel_scale, _ = grouped_matmul.to_panels(codes, scale, zero, bits=6)
    wrong = panel_codes.clone()
    wrong[1, 7, 96 + 64 + 3] ^= 0x20  # group 7's load 1, high byte 3's bit 5: position 35's nibble, bit 1 (h = 0)
    moved = (grouped_matmul.to_rows(wrong, panel_scale)[0] != codes).nonzero()  # position 35 = 16 * 2 + 2 * 1 + 1
    assert moved.tolist() == [[16 + 4 * 2 + 1, 7 * 16 + 8 + 1]]  # panel 1's output 9, input 8j + 0 + 0 + e = 9
    for rows in (1, 9):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        assert _error_ratio(grouped_matmul.grouped_matmul(x, panel_codes, panel_scale, None, None), x, weight) <= \
            _bound(512, 16)
        assert _error_ratio(grouped_matmul.grouped_matmul(x, wrong, panel_scale, None, None), x, weight) > \
            10 * _bound(512, 16)


def test_only_codes_in_six_bits_pack_into_six():
    codes, scale, _, _ = _weight(16, 64, "int8", 32, False, seed=75)
    codes[3, 9] = 32
    with pytest.raises(ValueError, match="6"):
        grouped_matmul.to_panels(codes, scale, None, bits=6)
    assert not grouped_matmul.fits_six_bits(codes) and grouped_matmul.fits_six_bits(codes.clamp(-32, 31))
