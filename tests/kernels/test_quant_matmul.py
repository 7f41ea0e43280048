"""The AVX512-BF16 quantized matmuls equal their float64 references up to float32 accumulation: int4
with W read by weight_unpack's reference (itself checked against torch's own int4 kernel), int8 as
(x @ q.T) * scale. They are built where the CPU has AVX512-BF16; elsewhere torch's kernels serve
(tests/runtime/test_quantized.py covers both through Int4Weight / Int8Weight)."""

import pytest
import torch

from kernels import cpu_extension, quant_matmul, weight_unpack
from runtime.model.quantized import Int4Weight, Int8Weight
from tests.runtime.quant_checks import exact_input, exact_weight, within_bound

HAS_AVX512_BF16 = quant_matmul.CPU_FLAGS <= cpu_extension.cpu_flags()
# a CPU-feature gate: these run where the kernel is built; elsewhere the portable check below runs instead
avx512_bf16 = pytest.mark.skipif(not HAS_AVX512_BF16,
                                 reason="this CPU has no AVX512-BF16 (the kernel is not built; torch's kernels serve)")

ACCUMULATION_RTOL = 1e-5  # of sum |x| |w| per output: float32 sums of exact bfloat16 products; a wrong
# nibble, scale, lane or pair order is off by a whole weight (~1e-2 of that sum and more)


def _assert_within_accumulation(out, reference, magnitude):
    assert out.shape == reference.shape and out.dtype == torch.float32
    error = (out.double() - reference).abs()
    assert bool((error <= ACCUMULATION_RTOL * magnitude + 1e-30).all()), float((error / (magnitude + 1e-30)).max())


@avx512_bf16
def test_builds_where_the_cpu_has_avx512_bf16():
    assert quant_matmul.available()


@pytest.mark.parametrize("out_features,in_features", [(64, 32), (200, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 64, 100])  # around the kernel's 6-row register block
@avx512_bf16
def test_int4_matches_reference(out_features, in_features, rows):
    torch.manual_seed(out_features * 7 + in_features + rows)
    weight = Int4Weight.quantize(torch.randn(out_features, in_features) * 0.1)
    x = torch.randn(rows, weight.packed.shape[1] * 2).bfloat16()
    out = quant_matmul.int4_matmul(x, weight.packed, weight.scales_zeros)
    dense = weight_unpack.unpack_int4_reference(weight.packed, weight.scales_zeros).double()
    # the weight unrounded, as the few-rows kernel (and torch's) multiplies by
    _assert_within_accumulation(out, quant_matmul.int4_few_rows_reference(x, weight.packed, weight.scales_zeros),
                                x.double().abs() @ dense.abs().T)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 37, 64])
@avx512_bf16
def test_int4_many_and_few_rows_kernels_agree_bit_for_bit(rows):
    """A prompt computed whole (many rows) and its last rows after a prefix-cache hit (few) see one function."""
    torch.manual_seed(rows)
    weight = Int4Weight.quantize(torch.randn(576, 1536) * 0.1)
    x = torch.randn(rows, 1536).bfloat16()
    many = quant_matmul.int4_matmul(x, weight.packed, weight.scales_zeros)
    few = torch.cat([quant_matmul.int4_matmul_few_rows(x[i : i + 1], weight.packed, weight.scales_zeros)
                     for i in range(rows)])
    assert torch.equal(many, few)


@pytest.mark.parametrize("rows", [1, 7, 20])
@avx512_bf16
def test_bfloat16_out_is_the_float32_out_rounded(rows):
    torch.manual_seed(rows)
    int4 = Int4Weight.quantize(torch.randn(128, 64) * 0.1)
    int8 = Int8Weight.quantize(torch.randn(32, 64))
    x = torch.randn(rows, 64).bfloat16()
    for fn, args in ((quant_matmul.int4_matmul, (int4.packed, int4.scales_zeros)),
                     (quant_matmul.int4_matmul_few_rows, (int4.packed, int4.scales_zeros)),
                     (quant_matmul.int8_matmul, (int8.q, int8.scale))):
        out = fn(x, *args, bf16_out=True)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out.view(torch.int16), fn(x, *args).bfloat16().view(torch.int16))


@avx512_bf16
def test_int4_a_wrong_weight_is_caught():
    """The tolerance is tight enough to see one nibble off in one group of one output."""
    torch.manual_seed(0)
    weight = Int4Weight.quantize(torch.randn(64, 64) * 0.1)
    x = torch.randn(3, 64).bfloat16()
    reference = quant_matmul.int4_few_rows_reference(x, weight.packed, weight.scales_zeros)
    weight.packed[5, 7] ^= 0x01  # one nibble of one output
    out = quant_matmul.int4_matmul(x, weight.packed, weight.scales_zeros)
    dense = weight_unpack.unpack_int4_reference(weight.packed, weight.scales_zeros).double()
    with pytest.raises(AssertionError):
        _assert_within_accumulation(out, reference, x.double().abs() @ dense.abs().T)


@avx512_bf16
def test_int4_bad_shapes_are_errors_not_crashes():
    ext = quant_matmul._extension()
    weight = Int4Weight.quantize(torch.randn(64, 64))
    with pytest.raises(ValueError, match="inputs"):
        ext.int4_matmul(torch.zeros(16, 32, dtype=torch.bfloat16), weight.packed, weight.scales_zeros, False)
    with pytest.raises(ValueError, match="bfloat16"):
        ext.int4_matmul(torch.zeros(16, 64), weight.packed, weight.scales_zeros, False)
    with pytest.raises(ValueError, match="multiple of 64"):
        ext.int4_matmul(torch.zeros(2, 64, dtype=torch.bfloat16), weight.packed[:32], weight.scales_zeros, False)


@pytest.mark.parametrize("out_features,in_features", [(16, 32), (160, 96), (49152 // 16, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 17, 64])  # each of the 4-, 2- and 1-row blocks and mixes
@avx512_bf16
def test_int8_matches_reference(out_features, in_features, rows):
    torch.manual_seed(out_features + in_features * 3 + rows)
    weight = Int8Weight.quantize(torch.randn(out_features, in_features))
    x = torch.randn(rows, in_features).bfloat16()
    out = quant_matmul.int8_matmul(x, weight.q, weight.scale)
    _assert_within_accumulation(out, quant_matmul.int8_matmul_reference(x, weight.q, weight.scale),
                                (x.double().abs() @ weight.q.double().abs().T) * weight.scale.double())


@avx512_bf16
def test_int8_bad_shapes_are_errors_not_crashes():
    ext = quant_matmul._extension()
    weight = Int8Weight.quantize(torch.randn(20, 64))
    with pytest.raises(ValueError, match="multiple of 16"):
        ext.int8_matmul(torch.zeros(2, 64, dtype=torch.bfloat16), weight.q, weight.scale, False)
    weight = Int8Weight.quantize(torch.randn(16, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        ext.int8_matmul(torch.zeros(2, 48, dtype=torch.bfloat16), weight.q, weight.scale, False)


@pytest.mark.parametrize("out_features,in_features", [(64, 32), (200, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13])  # around the 6-row register block
@avx512_bf16
def test_int4_few_rows_matches_the_unrounded_reference(out_features, in_features, rows):
    torch.manual_seed(out_features * 5 + in_features + rows)
    weight = Int4Weight.quantize(torch.randn(out_features, in_features) * 0.1)
    x = torch.randn(rows, weight.packed.shape[1] * 2).bfloat16()
    out = quant_matmul.int4_matmul_few_rows(x, weight.packed, weight.scales_zeros)
    # each group's sum times its scale, plus its zero times the inputs' sum: bounded by |x| (8 |scale| + |zero|)
    scales_zeros = weight.scales_zeros.double().abs().repeat_interleave(32, dim=0)  # [K, N, 2]
    magnitude = x.double().abs() @ (8 * scales_zeros[..., 0] + scales_zeros[..., 1])
    _assert_within_accumulation(out, quant_matmul.int4_few_rows_reference(x, weight.packed, weight.scales_zeros),
                                magnitude)


@pytest.mark.parametrize("rows", [2, 4, 6, 7, 9, 13])
@avx512_bf16
def test_int4_few_rows_a_row_does_not_depend_on_the_rows_beside_it(rows):
    # a verification step multiplies k + 1 rows where a decode multiplies one: greedy identity needs
    # each row's result bit for bit the same whichever rows came with it (and however they are blocked)
    torch.manual_seed(rows)
    weight = Int4Weight.quantize(torch.randn(192, 576) * 0.1)
    x = torch.randn(rows, 576).bfloat16()
    together = quant_matmul.int4_matmul_few_rows(x, weight.packed, weight.scales_zeros)
    for i in range(rows):
        alone = quant_matmul.int4_matmul_few_rows(x[i : i + 1], weight.packed, weight.scales_zeros)
        assert torch.equal(together[i : i + 1], alone), i


@avx512_bf16
def test_int4_few_rows_a_wrong_weight_is_caught():
    torch.manual_seed(1)
    weight = Int4Weight.quantize(torch.randn(64, 64) * 0.1)
    x = torch.randn(2, 64).bfloat16()
    reference = quant_matmul.int4_few_rows_reference(x, weight.packed, weight.scales_zeros)
    weight.packed[40, 9] ^= 0x10  # one high nibble: an output of the block's second half
    out = quant_matmul.int4_matmul_few_rows(x, weight.packed, weight.scales_zeros)
    assert float((out.double() - reference).abs().max()) > 1e-3


@pytest.mark.skipif(HAS_AVX512_BF16, reason="the kernel's own tests above run on this CPU")
@pytest.mark.parametrize("cls", [Int4Weight, Int8Weight])
def test_without_avx512_bf16_nothing_is_built_and_torchs_kernels_agree(cls):
    """The portable side of the gate: quant_matmul stays unbuilt, and the weights' matmuls (torch's int4 / int8
    kernels, the unpack past 64 rows) meet the exact-weight bound of tests/runtime/quant_checks.py (float32 sums
    and bfloat16's rounding of the output), which one nibble off fails (tests/runtime/test_quantized.py)."""
    assert not quant_matmul.available()
    weight, values, _ = exact_weight(cls, 200, 96, 3)
    for rows in (1, 7, 70):
        x = exact_input(rows, 96, rows, torch.float32)
        within, worst = within_bound(weight.linear(x), x, values)
        assert within, worst
