"""The Triton paged decode attention against the torch reference and a float64 computation."""

import pytest
import torch

import triton  # noqa: E402,F401  a dev dependency (`make test` installs it): missing is a failure, not a skip

import kernels  # noqa: E402
from kernels.decode_attention import paged_decode_attention as triton_decode  # noqa: E402
from kernels.reference import paged_decode_attention as reference_decode  # noqa: E402
from tests.kernels.helpers import assert_close, attend64, paged_problem, triton_devices  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CASES = [  # (context_lens, num_q_heads, num_kv_heads, head_dim, block_size): GQA 1, 2, 4, 8
    ([1, 16, 17, 45], 4, 4, 16, 16),
    ([3, 32, 8, 64], 8, 4, 8, 8),  # stories260K's head dim
    ([64, 5, 1, 96], 8, 2, 32, 32),
    ([33, 1, 50], 8, 1, 80, 16),  # head dim padded to 128
    ([128, 1, 130], 4, 2, 96, 128),  # big pages, head dim padded to 128
    ([64, 70], 4, 4, 64, 64),
]


def decode_problem(context_lens, hq, hkv, head_dim, block_size, dtype, seed, device):
    """(q, k_cache, v_cache, block_tables, context_lens) on `device`, plus float64 K/V per sequence."""
    k_cache, v_cache, tables, keys, values = paged_problem(context_lens, hkv, head_dim, block_size, dtype, seed)
    q = torch.randn(len(context_lens), hq, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    inputs = [t.to(device) for t in (q, k_cache, v_cache, tables, lens)]
    return inputs, keys, values


def check_decode(context_lens, hq, hkv, head_dim, block_size, dtype, seed, device, partition_size, window=None,
                 softcap=None):
    (q, k_cache, v_cache, tables, lens), keys, values = decode_problem(
        context_lens, hq, hkv, head_dim, block_size, dtype, seed, device
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))  # an element the kernel leaves unwritten fails below
    result = triton_decode(q, k_cache, v_cache, tables, lens, scale, window, out=out, partition_size=partition_size,
                           softcap=softcap)
    assert result is out
    expected = reference_decode(q, k_cache, v_cache, tables, lens, scale, window, softcap)
    assert_close(out, expected, dtype, "triton vs reference")
    for i, n in enumerate(context_lens):
        exact = attend64(q[i : i + 1].cpu(), keys[i], values[i], [n - 1], scale, window, softcap)[0]
        assert_close(out[i], exact, dtype, f"triton vs float64, sequence {i} (context {n})")


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("partition_size", [512, 16], ids=["one-partition", "partitions-of-16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("context_lens, hq, hkv, head_dim, block_size", CASES)
def test_decode_matches_reference_and_float64(context_lens, hq, hkv, head_dim, block_size, dtype, partition_size, device, seed):
    check_decode(context_lens, hq, hkv, head_dim, block_size, dtype, seed, device, partition_size)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_merges_more_partitions_than_one_merge_tile(dtype, device, seed):
    # 300 tokens in partitions of 16: 19 partitions, more than the merge kernel takes per iteration
    check_decode([300, 17, 1], 8, 2, 16, 16, dtype, seed, device, partition_size=16)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("partition_size", [512, 16], ids=["one-partition", "partitions-of-16"])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_soft_caps_the_scores(window, partition_size, device, seed):
    # a cap of 0.5 squashes every score (q . k / sqrt(d) ~ N(0, 1)), so an uncapped kernel fails
    check_decode([100, 40, 9, 1], 4, 2, 16, 8, torch.float32, seed, device, partition_size, window, softcap=0.5)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("partition_size", [512, 16], ids=["one-partition", "partitions-of-16"])
@pytest.mark.parametrize("window", [1, 20, 64])
def test_decode_sliding_window_skips_what_the_query_cannot_see(window, partition_size, device, seed):
    # with partitions of 16 and a window of 20, the first partitions of the 100-token sequence see nothing
    check_decode([100, 40, 9, 1, 64], 4, 2, 16, 8, torch.float32, seed, device, partition_size, window)


@pytest.mark.parametrize("device", triton_devices())
def test_dispatch_runs_the_triton_kernel(device, seed):
    (q, k_cache, v_cache, tables, lens), _, _ = decode_problem([5, 40], 4, 2, 16, 16, torch.float32, seed, device)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, backend="triton")
    expected = triton_decode(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_decode_launcher_rejects_bad_inputs_with_clear_errors():
    q = torch.randn(2, 4, 16)
    cache = torch.randn(8, 16, 2, 16)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_q_heads 3 is not a multiple of num_kv_heads 2"):
        triton_decode(torch.randn(2, 3, 16), cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="must share a dtype"):
        triton_decode(q.half(), cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        triton_decode(q, cache, cache, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match=r"context_lens must be \[num_seqs\] = \[2\], got \(1,\)"):
        triton_decode(q, cache, cache, tables, lens[:1], 1.0)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        triton_decode(q, cache, cache, tables, lens.long(), 1.0)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        triton_decode(q.transpose(1, 2).contiguous().transpose(1, 2), cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="partition_size must be a power of two"):
        triton_decode(q, cache, cache, tables, lens, 1.0, partition_size=48)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("partition_size", [512, 128])
def test_decode_llama3_8b_shapes_on_cuda(dtype, partition_size, seed):
    # 32 query heads over 8 KV heads, head dim 128, pages of 16; long and ragged contexts
    check_decode([1, 16, 511, 512, 2049, 4100], 32, 8, 128, 16, dtype, seed, "cuda", partition_size)
