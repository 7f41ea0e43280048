"""Cascade decode attention (shared prefixes read once per group) against float64, and its plan."""

import random

import pytest
import torch

from kernels import cascade, reference
from tests.kernels.helpers import RUN_SEED, assert_close, attend64


def shared_problem(groups, loners, num_kv_heads, head_dim, block_size, seed):
    """Page tables where each group's members begin with the same physical pages.

    groups: list of (shared_len, [member context lens]); loners: context lens with no sharing.
    Returns (k_cache, v_cache, tables, context_lens, keys, values), keys/values per row
    [context_len, num_kv_heads, head_dim] in float64, rows shuffled.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows = []  # (shared pages, shared K, shared V, own context len)
    specs = [(s, n) for s, members in groups for n in members] + [(0, n) for n in loners]
    shared_kv = {}
    num_blocks = sum(-(-n // block_size) for _, n in specs) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.rand(shape, generator=gen, dtype=torch.float64) * 1e4  # junk where nothing was written
    v_cache = torch.rand(shape, generator=gen, dtype=torch.float64) * 1e4
    for gi, (shared_len, _) in enumerate(groups):
        pages = [free.pop() for _ in range(shared_len // block_size)]
        k = torch.randn(shared_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
        v = torch.randn(shared_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
        shared_kv[gi] = (pages, k, v)
    group_of = [gi for gi, (_, members) in enumerate(groups) for _ in members] + [None] * len(loners)
    for (shared_len, n), gi in zip(specs, group_of):
        pages, k, v = shared_kv[gi] if gi is not None else ([], torch.empty(0, num_kv_heads, head_dim,
                                                                             dtype=torch.float64), None)
        if v is None:
            v = k.clone()
        own = n - len(pages) * block_size
        k_own = torch.randn(own, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
        v_own = torch.randn(own, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
        table = pages + [free.pop() for _ in range(-(-own // block_size))]
        rows.append((table, torch.cat([k, k_own]), torch.cat([v, v_own]), n))
    rng.shuffle(rows)
    for table, k, v, n in rows:
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        reference.write_kv(k, v, k_cache, v_cache, slots)
    tables = [r[0] for r in rows]
    return (k_cache.float(), v_cache.float(), tables, [r[3] for r in rows], [r[1] for r in rows],
            [r[2] for r in rows])


def padded(tables):
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


CASES = [  # (groups, loners, num_q_heads, num_kv_heads, head_dim, block_size, sliding_window)
    ([(64, [70, 65, 99, 64 + 16])], [5, 40], 8, 2, 16, 16, None),  # one group, ragged suffixes
    ([(32, [40, 33, 47]), (48, [49, 60])], [], 4, 4, 8, 8, None),  # two groups, MHA
    ([(96, [97, 120, 150, 101])], [200, 3], 8, 1, 16, 16, None),  # MQA
    ([(64, [70, 90, 130])], [30], 8, 2, 16, 16, 24),  # window: one member sees none of the prefix
    ([(64, [66, 80])], [12], 8, 2, 16, 16, 60),  # window cuts into the shared prefix
    ([(32, [40, 33])], [3, 5, 300, 9, 17], 8, 2, 16, 8, None),  # one long row: private parts in buckets
    ([], [3, 250, 5, 12, 260], 4, 2, 8, 8, 40),  # buckets, no group, sliding window
]


@pytest.mark.parametrize("native", [True, False], ids=["cpp-private", "flash-buckets"])
@pytest.mark.parametrize("groups, loners, hq, hkv, head_dim, block_size, window", CASES)
def test_cascade_matches_float64_and_the_reference(groups, loners, hq, hkv, head_dim, block_size, window, native):
    k_cache, v_cache, tables, lens, keys, values = shared_problem(groups, loners, hkv, head_dim, block_size, RUN_SEED)
    q = torch.randn(len(tables), hq, head_dim, generator=torch.Generator().manual_seed(RUN_SEED))
    scale = head_dim**-0.5
    plan = cascade.plan_decode(tables, lens, block_size, window, native=native)
    assert (plan.native is not None) == native and (plan.private == []) == native
    assert plan.num_shared_rows == sum(len(m) for _, m in groups)  # every member found its group
    out = cascade.cascade_decode_attention(q, k_cache, v_cache, plan, scale)
    ref = reference.paged_decode_attention(q, k_cache, v_cache, padded(tables), torch.tensor(lens, dtype=torch.int32),
                                           scale, window)
    for i, n in enumerate(lens):
        expected = attend64(q[i : i + 1], keys[i], values[i], [n - 1], scale, window)[0]
        assert_close(out[i], expected, torch.float32, f"cascade row {i}")
    assert_close(out, ref, torch.float32, "cascade vs reference")


@pytest.mark.parametrize("native", [True, False], ids=["cpp-private", "flash-buckets"])
def test_without_groups_the_plan_is_the_per_sequence_path(native):
    k_cache, v_cache, tables, lens, keys, values = shared_problem([], [9, 33, 64, 1], 2, 8, 8, RUN_SEED)
    q = torch.randn(len(tables), 4, 8, generator=torch.Generator().manual_seed(1))
    plan = cascade.plan_decode(tables, lens, 8, native=native)
    assert plan.groups == []
    out = cascade.cascade_decode_attention(q, k_cache, v_cache, plan, 0.3)
    for i, n in enumerate(lens):
        assert_close(out[i], attend64(q[i : i + 1], keys[i], values[i], [n - 1], 0.3)[0], torch.float32)


@pytest.mark.parametrize("native", [True, False], ids=["cpp-private", "flash-buckets"])
def test_plan_shares_only_full_pages_below_every_members_newest_token(native):
    # rows 0-2 share pages 7, 8, 9; row 2's newest token sits in page 9, so only 7 and 8 are shared
    tables = [[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 9], [5, 6, 4], [7, 3]]
    lens = [60, 55, 40, 40, 20]
    plan = cascade.plan_decode(tables, lens, 16, native=native)
    assert len(plan.groups) == 1
    group = plan.groups[0]
    assert group.pages == [7, 8] and group.rows == [0, 1, 2]
    # row 4 begins with page 7 too, but one common page is below the minimum: it reads alone
    assert plan.private_pages(0) == [9, 1]
    assert plan.private_pages(4) == [7, 3]


def test_plan_ignores_prefixes_shorter_than_the_minimum():
    tables = [[7, 1], [7, 2], [7, 3]]
    plan = cascade.plan_decode(tables, [30, 30, 30], 16, native=False)  # one common page < MIN_SHARED_PAGES
    assert plan.groups == []
    assert [plan.private_pages(i) for i in range(3)] == [[7, 1], [7, 2], [7, 3]]


def test_bucket_rows_pads_short_rows_apart_from_a_long_one():
    widths = [1] * 30 + [40] + [2] * 5
    buckets = cascade.bucket_rows(widths, call_pages=8)
    assert sorted(r for b in buckets for r in b) == list(range(len(widths)))  # every row once
    long_bucket = next(b for b in buckets if 30 in b)
    assert long_bucket == [30]  # 35 short rows padded to 40 pages would read 1,400 pages for ~40
    assert all(b == sorted(b) for b in buckets)
    cost = sum(len(b) * max(widths[r] for r in b) + 8 for b in buckets)
    assert cost <= 30 * 1 + 5 * 2 + 40 + 3 * 8  # no worse than one bucket per distinct width
    assert cost < len(widths) * 40 + 8  # and far better than one bucket


def test_bucket_rows_keeps_similar_rows_in_one_call():
    assert cascade.bucket_rows([5, 6, 5, 7], call_pages=48) == [[0, 1, 2, 3]]
    assert cascade.bucket_rows([]) == []
    assert cascade.bucket_rows([5, 6, 5, 7], call_pages=0) == [[0, 2], [1], [3]]  # free calls: no padding


def test_a_plan_with_a_long_row_splits_its_private_parts():
    tables = [[i] for i in range(6)] + [list(range(10, 50))]
    lens = [10] * 6 + [40 * 16]
    plan = cascade.plan_decode(tables, lens, 16, native=False)  # the C++ kernel needs no buckets
    assert len(plan.private) == 2
    assert [b.tables.shape[1] for b in plan.private] == [1, 40]
    assert plan.private_pages(6) == list(range(10, 50))


def test_native_plan_starts_each_row_past_its_shared_prefix_and_window():
    tables = [[7, 8, 9, 1], [7, 8, 9, 2], [5, 6]]
    plan = cascade.plan_decode(tables, [60, 55, 20], 16, sliding_window=30, native=True)
    assert plan.groups[0].pages == [7, 8, 9] and plan.private == []
    # rows 0-1 share 3 pages (48 positions); the window of 30 starts row 2 at 20 - 30 -> 0
    assert plan.native.starts.tolist() == [48, 48, 0] and plan.native.ends.tolist() == [60, 55, 20]
    assert [plan.private_pages(i) for i in range(3)] == [[1], [2], [5, 6]]
    with pytest.raises(ValueError):
        plan.private_pages(3)


def test_rows_of_one_owner_never_share_a_group_but_may_join_another_owners():
    # a verification: rows 0-2 are one sequence's k + 1 queries (one table, growing context); row 3 another
    # sequence over the same prefix pages
    table = [7, 8, 9, 1]
    tables, lens = [table, table, table, [7, 8, 9, 2]], [50, 51, 52, 60]
    assert [g.rows for g in cascade.plan_decode(tables, lens, 16, native=False).groups] == [[0, 1, 2, 3]]
    plan = cascade.plan_decode(tables, lens, 16, native=False, owners=[0, 0, 0, 1])
    assert [g.rows for g in plan.groups] == [[2, 3]]  # the last of owner 0's rows pairs with owner 1's row
    assert cascade.plan_decode(tables[:3], lens[:3], 16, native=False, owners=[0, 0, 0]).groups == []
