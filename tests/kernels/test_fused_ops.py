"""The C++ fused elementwise ops (kernels/fused_ops.py) against their torch forms, in float32 and bfloat16."""

import pytest
import torch

from kernels import fused_ops


def test_builds_here():
    """The machine that runs the suite has a compiler (scripts/system-deps.sh installs g++): the ops build."""
    if not fused_ops.native_for(torch.zeros(1)):
        raise AssertionError("the C++ fused ops did not build; see the cpu_kernels.unavailable log")


def _exact_or_close(actual, expected, dtype, what, exact):
    if exact:
        if not torch.equal(actual, expected):
            diff = (actual.double() - expected.double()).abs().max().item()
            raise AssertionError(f"{what} {dtype}: not bit-equal to torch (max diff {diff})")
    else:
        tol = {torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm(dtype, with_x, seed):
    gen = torch.Generator().manual_seed(seed)
    residual = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    x = torch.randn(37, 576, generator=gen).to(dtype) if with_x else None
    weight = torch.randn(576, generator=gen).to(dtype)
    ours_res, ref_res = residual.clone(), residual.clone()
    out = fused_ops.add_rms_norm(x, ours_res, weight, 1e-5, native=True)
    ref = fused_ops.add_rms_norm_torch(x, ref_res, weight, 1e-5)
    _exact_or_close(ours_res, ref_res, dtype, "residual sum", exact=True)  # one rounding, as torch
    _exact_or_close(out, ref, dtype, "norm", exact=False)  # the mean's order of summation differs
    if out.dtype != dtype or out.shape != residual.shape:
        raise AssertionError(f"{out.dtype} {tuple(out.shape)}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 8), (8, 1, 128)])
def test_rope_qkv_bit_equal_to_torch(dtype, num_q_heads, num_kv_heads, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = 29
    qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    angles = torch.rand(4096, head_dim // 2, generator=gen) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q, k = fused_ops.rope_qkv(qkv, positions, cos, sin, num_q_heads, num_kv_heads, native=True)
    q_ref, k_ref = fused_ops.rope_qkv_torch(qkv, positions, cos, sin, num_q_heads, num_kv_heads)
    _exact_or_close(q, q_ref, dtype, "q", exact=True)
    _exact_or_close(k, k_ref, dtype, "k", exact=True)
    if not (q.is_contiguous() and k.is_contiguous()):
        raise AssertionError("rope outputs must be contiguous")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(41, 2 * 1536, generator=gen) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # saturated and zero inputs
    _exact_or_close(fused_ops.silu_and_mul(gate_up, native=True), fused_ops.silu_and_mul_torch(gate_up), dtype,
                    "silu*up", exact=False)


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="residual"):
        fused_ops.add_rms_norm(None, torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4), 1e-5, native=True)
    with pytest.raises(ValueError, match="weight"):
        fused_ops.add_rms_norm(None, torch.zeros(3, 4), torch.zeros(5), 1e-5, native=True)
    cos = torch.zeros(16, 8)
    with pytest.raises(ValueError, match="outside the table"):
        fused_ops.rope_qkv(torch.zeros(2, 3 * 8), torch.tensor([0, 16]), cos, cos, 1, 1, native=True)
    with pytest.raises(ValueError, match="heads of head_dim"):
        fused_ops.rope_qkv(torch.zeros(2, 5 * 8), torch.tensor([0, 1]), cos, cos, 1, 1, native=True)
    with pytest.raises(ValueError, match="2 \\* size"):
        fused_ops.silu_and_mul(torch.zeros(2, 5), native=True)
