"""Shared by the kernel tests: random paged K/V problems and a float64 attention to check against."""

import os
import random

import pytest
import torch

from kernels import reference


def paged_problem(context_lens, num_kv_heads, head_dim, block_size, dtype, seed):
    """Random K/V per sequence scattered into shuffled pages; unused slots hold large junk.

    Returns (k_cache, v_cache, block_tables, keys, values): the caches
    [num_blocks, block_size, num_kv_heads, head_dim] in `dtype`, int32 block tables padded
    with 0, and per sequence its K and V [context_len, num_kv_heads, head_dim] in float64.
    """
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(pages_per_seq) + 3
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = (torch.rand(shape, generator=gen, dtype=torch.float64) * 1e4).to(dtype)
    v_cache = (torch.rand(shape, generator=gen, dtype=torch.float64) * 1e4).to(dtype)
    tables, keys, values = [], [], []
    for n, num_pages in zip(context_lens, pages_per_seq):
        table = [order.pop() for _ in range(num_pages)]
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        reference.write_kv(k, v, k_cache, v_cache, slots)
        tables.append(table)
        keys.append(k.double())
        values.append(v.double())
    width = max(pages_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, block_tables, keys, values


def attend64(q, k, v, q_positions, scale, sliding_window=None, softcap=None):
    """float64 attention of q [q_len, hq, d] at q_positions over k, v [ctx, hkv, d] (scores soft-capped if asked)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    kv_pos = torch.arange(k.shape[0])
    mask = kv_pos[None, :] > torch.tensor(q_positions)[:, None]
    if sliding_window is not None:
        mask |= kv_pos[None, :] <= torch.tensor(q_positions)[:, None] - sliding_window
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


# fresh random inputs every run; PAGEDSERVE_TEST_SEED=<n> replays a run (failures print n)
RUN_SEED = int(os.environ.get("PAGEDSERVE_TEST_SEED") or random.SystemRandom().randrange(2**31))
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # rtol = atol, per dtype


def assert_close(actual, expected, dtype, what=""):
    """assert_close at the dtype's tolerance; the message names the seed that replays the inputs."""
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        actual.double().cpu(), expected.double().cpu(), rtol=tol, atol=tol,
        msg=lambda m: f"{what}: {m}\n(inputs of PAGEDSERVE_TEST_SEED={RUN_SEED})",
    )


def triton_devices():
    """pytest params for the devices the Triton kernels run on here: the CPU under Triton's
    interpreter, CUDA when there is a GPU and the interpreter is off (TRITON_INTERPRET=0)."""
    from triton import knobs

    interpreted = knobs.runtime.interpret
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(not interpreted, reason="CPU tensors need TRITON_INTERPRET=1")),
        pytest.param("cuda", marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available() or interpreted, reason="needs CUDA and TRITON_INTERPRET=0"),
        ]),
    ]
