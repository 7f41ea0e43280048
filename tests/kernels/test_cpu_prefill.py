"""The CPU prefill path (cached part + causal chunk, kernels/cpu_prefill.py) against float64 and the reference."""

import pytest
import torch

from kernels import cpu_prefill, reference
from tests.kernels.helpers import assert_close, attend64, paged_problem

CASES = [  # (context_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size)
    ([1, 16, 17, 45], [1, 16, 5, 45], 4, 4, 16, 16),  # whole prompts, a middle chunk, one token
    ([3, 32, 8, 64], [3, 1, 8, 20], 8, 4, 8, 8),  # chunks after a cached prefix
    ([64, 5, 96], [64, 0, 33], 9, 3, 64, 16),  # a sequence with nothing new; SmolLM2's heads
    ([300, 70], [13, 70], 8, 1, 32, 16),  # a long cached part, MQA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens, q_lens, hq, hkv, head_dim, block_size", CASES)
def test_matches_float64_and_the_reference(context_lens, q_lens, hq, hkv, head_dim, block_size, dtype, seed):
    k_cache, v_cache, tables, keys, values = paged_problem(context_lens, hkv, head_dim, block_size, dtype, seed)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = cpu_prefill.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale)
    if out.dtype != dtype:
        raise AssertionError(f"dtype {out.dtype}")
    assert_close(out, reference.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale), dtype,
                 "cpu prefill vs reference")
    for i, (n, q_len) in enumerate(zip(context_lens, q_lens)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        exact = attend64(q[rows], keys[i], values[i], list(range(n - q_len, n)), scale)
        assert_close(out[rows], exact, dtype, f"cpu prefill vs float64, sequence {i} (context {n}, chunk {q_len})")


@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_sliding_window_matches_float64_and_the_reference(window, seed):
    """Each token sees the `window` positions ending at its own; chunks after long cached parts skip their pages."""
    context_lens, q_lens, hq, hkv, head_dim, block_size = [100, 40, 9, 64], [70, 40, 1, 5], 4, 2, 16, 8
    k_cache, v_cache, tables, keys, values = paged_problem(context_lens, hkv, head_dim, block_size, torch.float32, seed)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = cpu_prefill.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, window)
    assert_close(out, reference.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, window),
                 torch.float32, "cpu prefill vs reference")
    for i, (n, q_len) in enumerate(zip(context_lens, q_lens)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        exact = attend64(q[rows], keys[i], values[i], list(range(n - q_len, n)), scale, window)
        assert_close(out[rows], exact, torch.float32, f"windowed prefill vs float64, sequence {i}")
