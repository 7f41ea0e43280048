"""CPU matmuls through oneDNN's packed weights: same results as F.linear, unpadded, padded, and past the cap."""

import pytest
import torch
import torch.nn.functional as F

from runtime.model import linear



def test_the_pinned_torch_build_has_onednn():
    """torch==2.13.0's x86 wheel carries oneDNN; without it `linear` would take F.linear everywhere (correct, slower)."""
    assert linear.onednn_available()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("rows", [1, 37, linear.PACKED_MAX_TOKENS, linear.PACKED_MAX_TOKENS + 1, 192, 300,
                                  linear.PADDED_MAX_TOKENS, linear.PADDED_MAX_TOKENS + 1])
def test_packed_linear_matches_f_linear(rows, dtype, tol):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    if not linear.can_pack(weight):  # bfloat16 on a CPU without AVX512BW/VL/DQ: the dense path, never a crash
        assert dtype == torch.bfloat16 and not linear.onednn_bf16_available()
    packed = linear.pack(weight) if linear.can_pack(weight) else None
    out = linear.linear(x, weight, bias, packed)
    assert out.shape == (rows, 96) and out.dtype == dtype
    torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(), rtol=tol, atol=tol)


def test_warm_up_builds_each_distinct_shape_once():
    a, b = torch.randn(32, 16), torch.randn(48, 16)
    weights = [(a, None, linear.pack(a)), (a.clone(), None, linear.pack(a)), (b, None, linear.pack(b))]
    assert linear.warm_up(weights) == 2
