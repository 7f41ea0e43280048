"""The Triton KV write against the torch reference: exact equality, untouched slots unchanged."""

import pytest
import torch

import triton  # noqa: E402,F401  a dev dependency (`make test` installs it): missing is a failure, not a skip

from kernels.kv_write import write_kv as triton_write_kv  # noqa: E402
from kernels.reference import write_kv as reference_write_kv  # noqa: E402
from tests.kernels.helpers import triton_devices  # noqa: E402


def kv_problem(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, seed, device, fused=False):
    """New K/V rows, distinct random slots, and a cache of random junk, all on `device`.

    fused: key and value are strided views into one [num_tokens, q + k + v] projection, as the model makes them.
    """
    gen = torch.Generator().manual_seed(seed)
    if fused:
        qkv = torch.randn(num_tokens, (4 + 2) * num_kv_heads * head_dim, generator=gen).to(dtype)
        _, key, value = qkv.to(device).split([4 * num_kv_heads * head_dim, num_kv_heads * head_dim,
                                              num_kv_heads * head_dim], dim=-1)
        key = key.view(num_tokens, num_kv_heads, head_dim)
        value = value.view(num_tokens, num_kv_heads, head_dim)
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)  # int64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    return key, value, k_cache, v_cache, slots


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-qkv-views"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens, num_kv_heads, head_dim, block_size", [(1, 1, 8, 8), (37, 4, 80, 16), (20, 3, 16, 128)])
def test_write_kv_equals_reference_exactly(num_tokens, num_kv_heads, head_dim, block_size, dtype, fused, device, seed):
    key, value, k_cache, v_cache, slots = kv_problem(num_tokens, num_kv_heads, head_dim, block_size, 6, dtype, seed, device, fused)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference_write_kv(key, value, expected_k, expected_v, slots)
    triton_write_kv(key, value, k_cache, v_cache, slots)
    # whole caches: the written slots hold the new rows, every other slot its old junk
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)


@pytest.mark.parametrize("device", triton_devices())
def test_write_kv_casts_to_the_cache_dtype_like_the_reference(device, seed):
    key, value, k_cache, v_cache, slots = kv_problem(9, 2, 16, 16, 2, torch.float32, seed, device)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference_write_kv(key, value, expected_k, expected_v, slots)
    triton_write_kv(key, value, k_cache, v_cache, slots)
    # the GPU rounds float32 -> bfloat16 to nearest even like torch; Triton's interpreter
    # truncates, so on the CPU the rows may differ by one bfloat16 step (2**-7 relative)
    tol = 0 if device == "cuda" else 2**-7
    torch.testing.assert_close(k_cache, expected_k, rtol=tol, atol=0)
    torch.testing.assert_close(v_cache, expected_v, rtol=tol, atol=0)


def test_write_kv_launcher_rejects_bad_inputs_with_clear_errors():
    key = torch.randn(3, 2, 16)
    cache = torch.randn(4, 8, 2, 16)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        triton_write_kv(key, key, cache, cache, slots.int())
    with pytest.raises(ValueError, match=r"key rows are \[2, 8\], cache rows \(2, 16\)"):
        triton_write_kv(key[..., :8], key[..., :8], cache, cache, slots)
    with pytest.raises(ValueError, match="value shape"):
        triton_write_kv(key, key[:2], cache, cache, slots)
