"""The C++ paged decode kernel (kernels/cpu_attention.py) against float64 attention."""

import math

import pytest
import torch

from kernels import cpu_attention
from tests.kernels.helpers import assert_close, attend64, paged_problem


def test_builds_here():
    """The machine that runs the suite has a compiler (scripts/system-deps.sh installs g++): the kernel builds."""
    if not cpu_attention.available():
        raise AssertionError("the C++ CPU attention kernel did not build; see the cpu_kernels.unavailable log")


def _expected(q, keys, values, starts, ends, scale):
    """float64 out [S, Hq, D] and lse [S, Hq] of each row's query over positions [start, end)."""
    outs, lses = [], []
    for i, (k, v) in enumerate(zip(keys, values)):
        s, e = starts[i], ends[i]
        kk, vv = k[s:e], v[s:e]
        group = q.shape[1] // k.shape[1]
        scores = torch.einsum("hd,khd->hk", q[i].double(), kk.repeat_interleave(group, dim=1)) * scale
        lses.append(torch.logsumexp(scores, dim=-1))
        outs.append(attend64(q[i : i + 1], kk, vv, [e - s - 1], scale)[0])
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim, block_size",
    [(9, 3, 64, 16), (8, 8, 64, 16), (4, 1, 8, 4), (8, 2, 128, 32), (6, 2, 40, 8)],
)
def test_matches_float64(dtype, num_q_heads, num_kv_heads, head_dim, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    context_lens = [1, 5, block_size, block_size + 1, 77, 300]
    k_cache, v_cache, tables, keys, values = paged_problem(context_lens, num_kv_heads, head_dim, block_size, dtype, seed)
    q = torch.randn(len(context_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    starts = [0, 2, 0, block_size, 10, 3 * block_size]  # a private part starts past a shared prefix
    scale = head_dim**-0.5
    out, lse = cpu_attention.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(starts, dtype=torch.int32),
        torch.tensor(context_lens, dtype=torch.int32), scale,
    )
    want_out, want_lse = _expected(q, keys, values, starts, context_lens, scale)
    if out.dtype != dtype or lse.dtype != torch.float32:
        raise AssertionError(f"dtypes {out.dtype}, {lse.dtype}")
    assert_close(out.double(), want_out, dtype, f"out {dtype} seed={seed}")
    assert_close(lse.double(), want_lse, dtype, f"lse {dtype} seed={seed}")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_row_split_among_short_ones(threads, seed):
    """One long context among short ones is split across threads and merged; the result is unchanged."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [3000, 7, 12, 1, 640]
    k_cache, v_cache, tables, keys, values = paged_problem(context_lens, 3, 64, 16, torch.float32, seed)
    q = torch.randn(len(context_lens), 9, 64, generator=gen)
    starts = [0] * len(context_lens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = cpu_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, torch.zeros(5, dtype=torch.int32),
            torch.tensor(context_lens, dtype=torch.int32), 0.125,
        )
    finally:
        torch.set_num_threads(before)
    want_out, want_lse = _expected(q, keys, values, starts, context_lens, 0.125)
    assert_close(out.double(), want_out, torch.float32, f"out threads={threads} seed={seed}")
    assert_close(lse.double(), want_lse, torch.float32, f"lse threads={threads} seed={seed}")


def test_empty_range_gives_zero_and_minus_inf(seed):
    k_cache, v_cache, tables, _, _ = paged_problem([20, 20], 2, 64, 16, torch.float32, seed)
    q = torch.randn(2, 4, 64)
    out, lse = cpu_attention.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor([5, 0], dtype=torch.int32), torch.tensor([5, 20], dtype=torch.int32),
        0.125,
    )
    if out[0].abs().max().item() != 0.0 or not all(math.isinf(x) and x < 0 for x in lse[0].tolist()):
        raise AssertionError(f"empty row: out max {out[0].abs().max().item()}, lse {lse[0].tolist()}")
    if not torch.isfinite(lse[1]).all():
        raise AssertionError("the other row's lse is not finite")


@pytest.mark.parametrize(
    "change, message",
    [
        ("end_past_table", "outside its table"),
        ("page_past_cache", "outside the cache"),
        ("start_after_end", "outside its table"),
        ("int64_table", "int32"),
        ("mixed_dtype", "float32 or all bfloat16"),
        ("bad_groups", "multiple of num_kv_heads"),
    ],
)
def test_bad_input_raises_value_error(change, message, seed):
    k_cache, v_cache, tables, _, _ = paged_problem([20, 9], 2, 64, 16, torch.float32, seed)
    q = torch.randn(2, 4, 64)
    starts = torch.zeros(2, dtype=torch.int32)
    ends = torch.tensor([20, 9], dtype=torch.int32)
    if change == "end_past_table":
        ends = torch.tensor([20, 33], dtype=torch.int32)
    elif change == "page_past_cache":
        tables = tables.clone()
        tables[1, 0] = k_cache.shape[0]
    elif change == "start_after_end":
        starts = torch.tensor([0, 10], dtype=torch.int32)
    elif change == "int64_table":
        tables = tables.long()
    elif change == "mixed_dtype":
        q = q.bfloat16()
    elif change == "bad_groups":
        q = torch.randn(2, 3, 64)
    with pytest.raises(ValueError, match=message):
        cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, starts, ends, 0.125)


def test_turned_off_the_kernels_are_not_loaded_and_the_torch_path_serves(monkeypatch, seed):
    """PAGEDSERVE_CPU_KERNELS=torch (as where no compiler builds them): no module, and the plan falls back to buckets."""
    from kernels import cascade, cpu_extension

    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "torch")
    if cpu_extension.load.__wrapped__("paged_decode.cpp") is not None:  # the uncached loader sees the switch
        raise AssertionError("the kernel loaded although PAGEDSERVE_CPU_KERNELS=torch")
    monkeypatch.setattr(cpu_attention, "_extension", lambda: None)
    plan = cascade.plan_decode([[1, 2], [3]], [20, 9], 16)
    if plan.native is not None or not plan.private:
        raise AssertionError("without the kernel the plan must bucket the private parts")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_the_reference_with_strided_rows(dtype):
    """K and V straight out of fused qkv rows (V a strided view) land in their slots as index_copy_ puts them."""
    from kernels import reference

    torch.manual_seed(3)
    num_blocks, block_size, heads, dim, tokens = 6, 4, 3, 8, 7
    qkv = torch.randn(tokens, 4 * heads * dim).to(dtype)  # q (2 per KV head), k, v columns
    k = qkv[:, 2 * heads * dim : 3 * heads * dim].contiguous().view(tokens, heads, dim)
    v = qkv[:, 3 * heads * dim :].view(tokens, heads, dim)  # rows a qkv width apart
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    caches = [torch.zeros(num_blocks, block_size, heads, dim, dtype=dtype) for _ in range(4)]
    cpu_attention.write_kv(k, v, caches[0], caches[1], slots)
    reference.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


def test_write_kv_bad_input_raises_value_error():
    k = torch.randn(2, 3, 8)
    cache = torch.zeros(4, 4, 3, 8)
    with pytest.raises(ValueError, match="outside"):
        cpu_attention.write_kv(k, k, cache, cache.clone(), torch.tensor([0, 16]))
    with pytest.raises(ValueError, match="dtype"):
        cpu_attention.write_kv(k.bfloat16(), k.bfloat16(), cache, cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="do not match"):
        cpu_attention.write_kv(k, k, cache, cache.clone(), torch.tensor([0]))
