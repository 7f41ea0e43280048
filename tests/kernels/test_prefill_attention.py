"""The Triton paged prefill attention against the torch reference and a float64 computation."""

import pytest
import torch

import triton  # noqa: E402,F401  a dev dependency (`make test` installs it): missing is a failure, not a skip

import kernels  # noqa: E402
from kernels.prefill_attention import paged_prefill_attention as triton_prefill  # noqa: E402
from kernels.reference import paged_prefill_attention as reference_prefill  # noqa: E402
from tests.kernels.helpers import assert_close, attend64, paged_problem, triton_devices  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CASES = [  # (context_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size): GQA 1, 2, 4, 8
    ([1, 16, 17, 45], [1, 16, 5, 45], 4, 4, 16, 16),  # whole prompts, a middle chunk, one token
    ([3, 32, 8, 64], [3, 1, 8, 20], 8, 4, 8, 8),  # stories260K's head dim
    ([64, 5, 96], [64, 0, 33], 8, 2, 32, 32),  # a sequence with nothing new in this step
    ([33, 1, 50], [10, 1, 50], 8, 1, 80, 16),  # head dim padded to 128
    ([130, 128], [130, 2], 4, 2, 96, 128),  # big pages, head dim padded to 128
]


def prefill_problem(context_lens, q_lens, hq, hkv, head_dim, block_size, dtype, seed, device):
    """(q, k_cache, v_cache, block_tables, query_start_loc, context_lens) on `device`, plus float64 K/V."""
    k_cache, v_cache, tables, keys, values = paged_problem(context_lens, hkv, head_dim, block_size, dtype, seed)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    inputs = [t.to(device) for t in (q, k_cache, v_cache, tables, starts, lens)]
    return inputs, keys, values


def check_prefill(context_lens, q_lens, hq, hkv, head_dim, block_size, dtype, seed, device, window=None, softcap=None):
    (q, k_cache, v_cache, tables, starts, lens), keys, values = prefill_problem(
        context_lens, q_lens, hq, hkv, head_dim, block_size, dtype, seed, device
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))  # an element the kernel leaves unwritten fails below
    result = triton_prefill(q, k_cache, v_cache, tables, starts, lens, scale, window, out=out, softcap=softcap)
    assert result is out
    expected = reference_prefill(q, k_cache, v_cache, tables, starts, lens, scale, window, softcap)
    assert_close(out, expected, dtype, "triton vs reference")
    for i, (n, q_len) in enumerate(zip(context_lens, q_lens)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        exact = attend64(q[rows].cpu(), keys[i], values[i], list(range(n - q_len, n)), scale, window, softcap)
        assert_close(out[rows], exact, dtype, f"triton vs float64, sequence {i} (context {n}, chunk {q_len})")


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("context_lens, q_lens, hq, hkv, head_dim, block_size", CASES)
def test_prefill_matches_reference_and_float64(context_lens, q_lens, hq, hkv, head_dim, block_size, dtype, device, seed):
    check_prefill(context_lens, q_lens, hq, hkv, head_dim, block_size, dtype, seed, device)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_soft_caps_the_scores(window, device, seed):
    check_prefill([100, 40, 9], [70, 40, 1], 4, 2, 16, 8, torch.float32, seed, device, window, softcap=0.5)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("window", [1, 7, 40])
def test_prefill_sliding_window_limits_each_token(window, device, seed):
    check_prefill([100, 40, 9], [70, 40, 1], 4, 2, 16, 8, torch.float32, seed, device, window)


@pytest.mark.parametrize("device", triton_devices())
def test_dispatch_runs_the_triton_kernel(device, seed):
    (q, k_cache, v_cache, tables, starts, lens), _, _ = prefill_problem(
        [5, 40], [5, 12], 4, 2, 16, 16, torch.float32, seed, device
    )
    out = kernels.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, backend="triton")
    expected = triton_prefill(q, k_cache, v_cache, tables, starts, lens, 0.25)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_prefill_launcher_rejects_bad_inputs_with_clear_errors():
    q = torch.randn(3, 4, 16)
    cache = torch.randn(8, 16, 2, 16)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    starts = torch.tensor([0, 1, 3], dtype=torch.int32)
    lens = torch.tensor([4, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"query_start_loc must be int32 \[3\]"):
        triton_prefill(q, cache, cache, tables, starts[:2], lens, 1.0)
    with pytest.raises(ValueError, match="q head_dim 8 != cache head_dim 16"):
        triton_prefill(torch.randn(3, 4, 8), cache, cache, tables, starts, lens, 1.0)
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        triton_prefill(q, cache, cache, tables, starts, lens, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="dtype torch.float64 not supported"):
        triton_prefill(q.double(), cache.double(), cache.double(), tables, starts, lens, 1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_llama3_8b_shapes_on_cuda(dtype, seed):
    # 32 query heads over 8 KV heads, head dim 128, pages of 16; prompts, chunks after prefix hits, decodes
    check_prefill([1, 700, 1040, 2049, 300], [1, 700, 16, 512, 1], 32, 8, 128, 16, dtype, seed, "cuda")
