"""The C++ unpack of quantized weights equals its torch reference bit for bit, and the reference
reads torch's packed int4 layout right (it equals what torch's own int4 kernel multiplies by)."""

import pytest
import torch

from kernels import weight_unpack
from runtime.model.quantized import Int4Weight, Int8Weight


@pytest.mark.parametrize("out_features,in_features", [(64, 32), (128, 96), (200, 576), (960, 576)])
def test_int4_reference_reads_torch_layout_and_kernel_matches_it(out_features, in_features):
    torch.manual_seed(out_features + in_features)
    weight = Int4Weight.quantize(torch.randn(out_features, in_features) * 0.1)
    reference = weight_unpack.unpack_int4_reference(weight.packed, weight.scales_zeros)
    assert reference.shape == (weight.packed.shape[0], weight.packed.shape[1] * 2)
    # the values torch's int4 matmul multiplies by (read through it with an identity input), in bfloat16
    through_kernel = weight.dequantize()
    assert torch.equal(reference[:out_features, :in_features], through_kernel.bfloat16())
    unpacked = weight_unpack.unpack_int4(weight.packed, weight.scales_zeros)
    assert unpacked is not None, "the C++ kernels build on every machine the tests run on"
    assert torch.equal(unpacked.view(torch.int16), reference.view(torch.int16))


@pytest.mark.parametrize("out_features,in_features", [(1, 16), (37, 80), (49152 // 64, 576)])
def test_int8_kernel_matches_reference(out_features, in_features):
    torch.manual_seed(out_features)
    weight = Int8Weight.quantize(torch.randn(out_features, in_features))
    reference = weight_unpack.unpack_int8_reference(weight.q, weight.scale)
    unpacked = weight_unpack.unpack_int8(weight.q, weight.scale)
    assert torch.equal(unpacked.view(torch.int16), reference.view(torch.int16))
    assert torch.equal(reference[:, :in_features], weight.dequantize().bfloat16())


def test_bad_shapes_are_errors_not_crashes():
    with pytest.raises(ValueError, match=f"multiple of {weight_unpack.block_rows()}"):
        weight_unpack.unpack_int4(torch.zeros(40, 16, dtype=torch.uint8), torch.zeros(1, 40, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="scales_zeros"):
        weight_unpack.unpack_int4(torch.zeros(64, 16, dtype=torch.uint8), torch.zeros(2, 64, 2, dtype=torch.bfloat16))
