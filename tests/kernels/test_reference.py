"""The torch reference kernels against a plain float64 computation on contiguous K/V."""

import pytest
import torch

import kernels
from tests.kernels.helpers import attend64, paged_problem


CASES = [  # (context_lens, num_q_heads, num_kv_heads, head_dim, block_size)
    ([1, 16, 17, 45], 4, 4, 16, 16),
    ([3, 32, 8], 8, 4, 8, 8),
    ([64, 5], 8, 2, 32, 16),
    ([33, 1, 50], 8, 1, 16, 32),
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens, hq, hkv, head_dim, block_size", CASES)
def test_decode_matches_float64(context_lens, hq, hkv, head_dim, block_size, dtype):
    k_cache, v_cache, tables, keys, values = paged_problem(context_lens, hkv, head_dim, block_size, dtype, seed=hq)
    q = torch.randn(len(context_lens), hq, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = head_dim**-0.5
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32), scale)
    assert out.shape == q.shape and out.dtype == dtype
    for i, n in enumerate(context_lens):
        expected = attend64(q[i : i + 1], keys[i], values[i], [n - 1], scale)[0]
        torch.testing.assert_close(out[i].double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("context_lens, hq, hkv, head_dim, block_size", CASES)
def test_prefill_chunks_match_float64(context_lens, hq, hkv, head_dim, block_size):
    k_cache, v_cache, tables, keys, values = paged_problem(context_lens, hkv, head_dim, block_size, torch.float32, seed=7)
    q_lens = [max(1, n // 3) for n in context_lens]  # the newest third of each context is the chunk
    q = torch.randn(sum(q_lens), hq, head_dim, generator=torch.Generator().manual_seed(2))
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    scale = head_dim**-0.5
    out = kernels.paged_prefill_attention(
        q, k_cache, v_cache, tables, starts, torch.tensor(context_lens, dtype=torch.int32), scale
    )
    for i, (n, q_len) in enumerate(zip(context_lens, q_lens)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        expected = attend64(q[rows], keys[i], values[i], list(range(n - q_len, n)), scale)
        torch.testing.assert_close(out[rows].double(), expected, rtol=1e-5, atol=1e-5)


def test_sliding_window_limits_what_decode_and_prefill_see():
    context_lens, window = [40, 9], 8
    k_cache, v_cache, tables, keys, values = paged_problem(context_lens, 2, 16, 8, torch.float32, seed=3)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, sliding_window=window)
    prefill = kernels.paged_prefill_attention(
        q, k_cache, v_cache, tables, torch.tensor([0, 1, 2], dtype=torch.int32), lens, 0.25, sliding_window=window
    )
    for i, n in enumerate(context_lens):
        expected = attend64(q[i : i + 1], keys[i], values[i], [n - 1], 0.25, window)[0]
        torch.testing.assert_close(out[i].double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(prefill[i].double(), expected, rtol=1e-5, atol=1e-5)


def test_unknown_backend_is_a_clear_error():
    q = torch.zeros(1, 1, 8)
    cache = torch.zeros(1, 16, 1, 8)
    with pytest.raises(kernels.KernelBackendError):
        kernels.paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                       torch.ones(1, dtype=torch.int32), 1.0, backend="cuda-magic")
