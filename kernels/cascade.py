r"""The CPU's decode attention: shared prefixes read once per group (cascade), the rest per sequence.

In a decode step, sequences whose page tables begin with the same physical pages (a system
prompt served from the prefix cache) attend to those pages together, and each to its own
pages separately; the two partial results merge exactly through their log-sum-exps:

    seq a:  | P0 P1 P2 P3 | a4 a5 |          shared part: queries of a, b, c (all heads of a
    seq b:  | P0 P1 P2 P3 | b4 |             group as rows) x K/V of P0..P3, one product
    seq c:  | P0 P1 P2 P3 | c4 c5 c6 |       private part: each query x its own pages

    out = (exp(lse_s) * out_s + exp(lse_p) * out_p) / (exp(lse_s) + exp(lse_p))

A sequence in no group has only a private part: that is the per-sequence paged path. The
private parts go through the C++ kernel (kernels/cpu_attention.py), which reads every row's
positions [start, end) from its pages in place, one call per layer for the whole batch. Where
that kernel cannot build, they go through torch's CPU flash attention instead, gathered and
padded per bucket of rows of similar length, not all to the longest row: one long sequence in
a batch of short ones would otherwise multiply the pages copied and attended. The shared part
always uses flash attention with a decode trick for grouped-query attention: the query heads
that share a KV head are that head's query rows, so K/V are never repeated, and a group's
members are the rows of one product over the prefix.

The plan (which rows share which pages) is computed once per step from the block tables
(`plan_decode`) and used by every layer. kernels/reference.py stays the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import cpu_attention

MIN_SHARED_PAGES = 2  # a shorter common prefix is cheaper read per sequence
BUCKET_CALL_PAGES = 24  # what one more flash call per layer costs, in (row x page) units of padding


@dataclass
class PrefixGroup:
    """Decode rows whose page tables begin with the same pages."""

    pages: list[int]
    rows: list[int]  # rows of the decode batch, ascending


@dataclass
class SharedPrefixes:
    """A step's groups padded into one batch, so each layer reads them all in one call.

    Group g's members sit in slots g * max_members + j; padding slots repeat a real member
    and padding pages a real page, and are masked or ignored.
    """

    tables: torch.Tensor  # int64 [num_groups, max_shared_pages]
    member_rows: torch.Tensor  # int64 [num_groups, max_members]; decode rows (padded)
    bias: torch.Tensor  # float32 [num_groups, 1, max_members or 1, 1, max_shared_pages * block_size]
    rows: torch.Tensor  # int64 [num_members]; every member's decode row
    slots: torch.Tensor  # int64 [num_members]; its slot in [num_groups * max_members]
    empty: torch.Tensor | None = None  # bool [num_members]; sliding window: sees none of its prefix
    row_bias: dict = field(default_factory=dict)  # (group_size, dtype) -> bias per query row, made by the first layer

    def bias_for(self, group_size: int, dtype: torch.dtype) -> torch.Tensor:
        """bias expanded to every query row of a group: [num_groups, 1, max_members * group_size, Ls], once per step."""
        key = (group_size, dtype)
        if key not in self.row_bias:
            num_groups, max_members = self.member_rows.shape
            self.row_bias[key] = self.bias.expand(-1, -1, max_members, group_size, -1).reshape(
                num_groups, 1, max_members * group_size, -1).to(dtype)
        return self.row_bias[key]


@dataclass
class PrivateBucket:
    """Decode rows whose private pages are padded to one width: one flash call per layer."""

    rows: torch.Tensor | None  # int64 [n]; decode rows; None: every row, in order
    tables: torch.Tensor  # int32 [n, width]; pages after each row's shared prefix
    bias: torch.Tensor  # float32 [n, 1, 1, width * block_size]; 0 or -inf
    num_pages: list[int]  # each row's own private pages; the rest of its table row is padding


@dataclass
class NativeRows:
    """Every decode row's private positions, for the C++ kernel: read from the full tables in place."""

    tables: torch.Tensor  # int32 [num_seqs, max_blocks]; each row's whole page table, padded with 0
    starts: torch.Tensor  # int32 [num_seqs]; first private position (past the shared prefix and the window)
    ends: torch.Tensor  # int32 [num_seqs]; the context length
    first_pages: list[int]  # per row: its first private page (the shared prefix's length in pages)
    num_pages: list[int]  # per row: the pages of its table


@dataclass
class DecodePlan:
    """Per step: every decode row's private part (native rows or buckets), and the groups that read a shared prefix."""

    num_seqs: int
    private: list[PrivateBucket]  # empty when `native` holds the private parts
    groups: list[PrefixGroup] = field(default_factory=list)
    shared: SharedPrefixes | None = None  # the groups, batched; None without groups
    native: NativeRows | None = None  # the C++ kernel's rows; None: the buckets

    @property
    def num_shared_rows(self) -> int:
        return sum(len(g.rows) for g in self.groups)

    def private_pages(self, row: int) -> list[int]:
        """The pages decode row `row` reads on its own (padding left out)."""
        if self.native is not None:
            if not 0 <= row < self.num_seqs:
                raise ValueError(f"row {row} is not in a plan for {self.num_seqs} rows")
            table = self.native.tables[row].tolist()
            return table[self.native.first_pages[row] : self.native.num_pages[row]]
        for bucket in self.private:
            rows = list(range(self.num_seqs)) if bucket.rows is None else bucket.rows.tolist()
            if row in rows:
                i = rows.index(row)
                return bucket.tables[i].tolist()[: bucket.num_pages[i]]
        raise ValueError(f"row {row} is in no bucket of a plan for {self.num_seqs} rows")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_decode(
    tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    sliding_window: int | None = None,
    device: torch.device | None = None,
    min_shared_pages: int = MIN_SHARED_PAGES,
    bucket_call_pages: int = BUCKET_CALL_PAGES,
    native: bool | None = None,
    owners: list[int] | None = None,
) -> DecodePlan:
    """Group decode rows by the physical pages their tables start with.

    `owners` (one per row): rows with the same owner (a verification's k + 1 queries of one
    sequence) never share a group, so each is computed as that sequence's lone decode would be.

    `native`: whether the private parts go through the C++ kernel; None: wherever it is
    available for CPU tensors.

    Sorting the tables puts rows with a common prefix next to each other; walking them in
    that order, a row joins the group before it while that saves page reads (the group's
    prefix is what all its members share). Shared pages stop before the page holding any
    member's newest token, so every row keeps a private part (its own token at least) and
    the shared pages are full for all members. Groups of one are per-sequence rows. The
    private parts go in buckets (`bucket_rows`).
    """
    num_seqs = len(tables)
    if len(context_lens) != num_seqs:
        raise ValueError(f"{num_seqs} tables but {len(context_lens)} context lengths")
    # pages a row may share: full ones, before the page holding its newest token
    caps = [min(len(t), (n - 1) // block_size) for t, n in zip(tables, context_lens)]
    runs: list[tuple[int, list[int]]] = []  # (shared pages, rows), in sorted order
    # an owner's rows share one table and are consecutive in the batch, so the sort keeps them together:
    # a run holds one of them only if its last row does
    for i in sorted(range(num_seqs), key=lambda r: tables[r]):
        if runs and (owners is None or owners[runs[-1][1][-1]] != owners[i]):
            common, rows = runs[-1]
            prev = rows[-1]
            shared = min(_common_prefix(tables[prev], tables[i]), caps[prev], caps[i])
            if len(rows) == 1 and shared >= min_shared_pages:
                runs[-1] = (shared, rows + [i])
                continue
            # joining a group cuts its prefix to `shared`: worth it if fewer pages are read in all
            if len(rows) > 1 and shared >= min_shared_pages and len(rows) * shared >= (len(rows) - 1) * common:
                runs[-1] = (min(common, shared), rows + [i])
                continue
        runs.append((0, [i]))
    shared_pages = [0] * num_seqs
    groups: list[tuple[list[int], list[int]]] = []  # (pages, rows)
    for num_pages, rows in runs:
        if len(rows) > 1:
            groups.append((tables[rows[0]][:num_pages], sorted(rows)))
            for i in rows:
                shared_pages[i] = num_pages
    lens = torch.tensor(context_lens, dtype=torch.int64, device=device)  # [num_seqs]
    plan_groups = [PrefixGroup(pages, rows) for pages, rows in groups]
    shared = _batch_groups(plan_groups, lens, block_size, sliding_window, device) if groups else None
    if native is None:
        native = (device is None or torch.device(device).type == "cpu") and cpu_attention.available()
    if native:
        width = max((len(t) for t in tables), default=0)
        starts = [s * block_size if sliding_window is None else max(s * block_size, n - sliding_window)
                  for s, n in zip(shared_pages, context_lens)]
        rows = NativeRows(
            tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                device=device).reshape(num_seqs, width),
            starts=torch.tensor(starts, dtype=torch.int32, device=device),
            ends=torch.tensor(context_lens, dtype=torch.int32, device=device),
            first_pages=shared_pages,
            num_pages=[len(t) for t in tables],
        )
        return DecodePlan(num_seqs, [], plan_groups, shared, rows)
    private = [table[shared:] for table, shared in zip(tables, shared_pages)]
    starts = torch.tensor(shared_pages, dtype=torch.int64, device=device) * block_size  # [num_seqs]
    buckets = []
    for rows in bucket_rows([len(p) for p in private], bucket_call_pages):
        width = max((len(private[r]) for r in rows), default=0)
        bucket_tables = torch.tensor([private[r] + [0] * (width - len(private[r])) for r in rows], dtype=torch.int32,
                                     device=device).reshape(len(rows), width)
        every_row = len(rows) == num_seqs
        index = None if every_row else torch.tensor(rows, dtype=torch.int64, device=device)
        row_starts, row_lens = (starts, lens) if every_row else (starts[index], lens[index])
        positions = row_starts[:, None] + torch.arange(width * block_size, device=device)[None, :]  # [n, Lp]
        visible = positions < row_lens[:, None]
        if sliding_window is not None:
            visible &= positions >= row_lens[:, None] - sliding_window
        buckets.append(PrivateBucket(index, bucket_tables, _bias(visible)[:, None, None, :],
                                     [len(private[r]) for r in rows]))
    return DecodePlan(num_seqs, buckets, plan_groups, shared)


def bucket_rows(widths: list[int], call_pages: int = BUCKET_CALL_PAGES) -> list[list[int]]:
    """Rows split into buckets, each padded to its longest: least padding plus calls.

    Over the distinct widths in ascending order, a bucket is a run of them; its cost is its
    rows times its widest (the pages read, padding included) plus `call_pages` for the call.
    The cheapest split is a small dynamic program over the distinct widths (at most a few
    dozen). Rows keep ascending order within a bucket; one bucket holds them all in order.
    """
    if not widths:
        return []
    distinct = sorted(set(widths))
    counts = [0] * len(distinct)
    where = {w: i for i, w in enumerate(distinct)}
    for w in widths:
        counts[where[w]] += 1
    below = [0]  # rows with width below distinct[i]
    for c in counts:
        below.append(below[-1] + c)
    best = [0.0] + [float("inf")] * len(distinct)  # best[j]: cheapest split of the first j widths
    cut = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        for i in range(j):
            cost = best[i] + (below[j] - below[i]) * distinct[j - 1] + call_pages
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds = []
    j = len(distinct)
    while j > 0:
        bounds.append((distinct[cut[j]], distinct[j - 1]))
        j = cut[j]
    if len(bounds) == 1:
        return [list(range(len(widths)))]
    return [[r for r, w in enumerate(widths) if lo <= w <= hi] for lo, hi in reversed(bounds)]


def _batch_groups(groups: list[PrefixGroup], lens: torch.Tensor, block_size: int, sliding_window: int | None,
                  device: torch.device | None) -> SharedPrefixes:
    """Pad the groups into one batch (SharedPrefixes)."""
    max_pages = max(len(g.pages) for g in groups)
    max_members = max(len(g.rows) for g in groups)
    tables = [g.pages + [g.pages[0]] * (max_pages - len(g.pages)) for g in groups]
    member_rows = [g.rows + [g.rows[0]] * (max_members - len(g.rows)) for g in groups]
    rows = [r for g in groups for r in g.rows]
    slots = [gi * max_members + j for gi, g in enumerate(groups) for j in range(len(g.rows))]
    shared_pos = torch.arange(max_pages * block_size, device=device)  # [Ls]
    group_len = torch.tensor([len(g.pages) * block_size for g in groups], device=device)  # [num_groups]
    visible = shared_pos[None, None, :] < group_len[:, None, None]  # [num_groups, 1, Ls]
    empty = None
    member_rows_t = torch.tensor(member_rows, dtype=torch.int64, device=device)
    if sliding_window is not None:  # each member sees the part of its prefix inside its window
        seen = shared_pos[None, None, :] >= lens[member_rows_t][:, :, None] - sliding_window
        visible = visible & seen  # [num_groups, max_members, Ls]
        empty = ~visible.reshape(-1, visible.shape[-1]).any(dim=1)[torch.tensor(slots, device=device)]
        visible = visible | _empty_rows(visible)  # rows that see nothing: unmasked, then weighted 0
    return SharedPrefixes(
        tables=torch.tensor(tables, dtype=torch.int64, device=device),
        member_rows=member_rows_t,
        bias=_bias(visible)[:, None, :, None, :],
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        slots=torch.tensor(slots, dtype=torch.int64, device=device),
        empty=empty,
    )


def _empty_rows(visible: torch.Tensor) -> torch.Tensor:
    """[..., L] bool: True across the rows of `visible` that see nothing (so they stay finite)."""
    return ~visible.any(dim=-1, keepdim=True)


def _bias(visible: torch.Tensor) -> torch.Tensor:
    """0 where visible, -inf elsewhere (float32)."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, float("-inf"))


def _flash(q, k, v, bias, scale):
    """torch's CPU flash attention: (out [B, H, Lq, d], lse [B, H, Lq]); k, v [B, H, Lk, d]."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)


def _private_attention(q_rows, k_cache, v_cache, bucket: PrivateBucket, scale: float):
    """One bucket's rows over their own pages: (out [n, kv_heads, group, d], lse [n, kv_heads, group])."""
    n, num_kv_heads, _, head_dim = q_rows.shape
    pages = bucket.tables.reshape(-1)
    k = k_cache.index_select(0, pages).view(n, -1, num_kv_heads, head_dim).float()
    v = v_cache.index_select(0, pages).view(n, -1, num_kv_heads, head_dim).float()
    return _flash(q_rows, k.transpose(1, 2), v.transpose(1, 2), bucket.bias, scale)


def _bucketed_private(q_rows, k_cache, v_cache, buckets: list[PrivateBucket], scale: float):
    """Every row over its own pages, bucket by bucket: (out [n, kv_heads, group, d], lse [n, kv_heads, group])."""
    if len(buckets) == 1 and buckets[0].rows is None:
        return _private_attention(q_rows, k_cache, v_cache, buckets[0], scale)
    out = q_rows.new_empty(q_rows.shape)
    lse = q_rows.new_empty(q_rows.shape[:-1])
    for bucket in buckets:
        out_b, lse_b = _private_attention(q_rows.index_select(0, bucket.rows), k_cache, v_cache, bucket, scale)
        out.index_copy_(0, bucket.rows, out_b)
        lse.index_copy_(0, bucket.rows, lse_b)
    return out, lse


def cascade_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Decode attention through `plan`: each shared prefix once per group, private pages per row."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if plan.num_seqs != num_seqs:
        raise ValueError(f"plan for {plan.num_seqs} rows, but {num_seqs} queries")
    group_size = num_q_heads // num_kv_heads
    if plan.native is not None:
        rows = plan.native
        out_n, lse_n = cpu_attention.paged_decode_attention(q, k_cache, v_cache, rows.tables, rows.starts, rows.ends,
                                                            scale)  # [num_seqs, num_q_heads, head_dim], [num_seqs, num_q_heads]
        if plan.shared is None:
            return out_n
        out = out_n.float().view(num_seqs, num_kv_heads, group_size, head_dim)
        lse = lse_n.view(num_seqs, num_kv_heads, group_size)
    q_rows = q.float().reshape(num_seqs, num_kv_heads, group_size, head_dim)  # heads of one KV head as rows
    if plan.native is None:
        out, lse = _bucketed_private(q_rows, k_cache, v_cache, plan.private, scale)
    # out [num_seqs, num_kv_heads, group_size, head_dim], lse [num_seqs, num_kv_heads, group_size]
    shared = plan.shared
    if shared is None:
        return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)
    num_groups, max_members = shared.member_rows.shape
    # the shared part in the cache's dtype (flash accumulates in float32): no float copy of the prefix pages
    k_shared = k_cache.index_select(0, shared.tables.reshape(-1)).view(num_groups, -1, num_kv_heads, head_dim)
    v_shared = v_cache.index_select(0, shared.tables.reshape(-1)).view(num_groups, -1, num_kv_heads, head_dim)
    rows_per_group = max_members * group_size
    q_groups = q_rows.index_select(0, shared.member_rows.reshape(-1))  # [G * M, num_kv_heads, group_size, d]
    q_groups = q_groups.view(num_groups, max_members, num_kv_heads, group_size, head_dim).transpose(1, 2)
    bias = shared.bias_for(group_size, k_cache.dtype)  # [num_groups, 1, rows_per_group, Ls]
    out_s, lse_s = _flash(q_groups.reshape(num_groups, num_kv_heads, rows_per_group, head_dim).to(k_cache.dtype),
                          k_shared.transpose(1, 2), v_shared.transpose(1, 2), bias, scale)
    out_s = out_s.float()
    # out_s [G, num_kv_heads, M * group_size, d] -> per slot [G * M, num_kv_heads, group_size, d]
    out_s = out_s.view(num_groups, num_kv_heads, max_members, group_size, head_dim).transpose(1, 2)
    out_s = out_s.reshape(num_groups * max_members, num_kv_heads, group_size, head_dim).index_select(0, shared.slots)
    lse_s = lse_s.view(num_groups, num_kv_heads, max_members, group_size).transpose(1, 2)
    lse_s = lse_s.reshape(num_groups * max_members, num_kv_heads, group_size).index_select(0, shared.slots)
    if shared.empty is not None:  # a row that sees nothing shared gets weight 0
        lse_s = lse_s.masked_fill(shared.empty[:, None, None], float("-inf"))
    out_p, lse_p = out.index_select(0, shared.rows), lse.index_select(0, shared.rows)
    lse_all = torch.logaddexp(lse_p, lse_s)  # [members, num_kv_heads, group_size]
    merged = out_p * torch.exp(lse_p - lse_all)[..., None] + out_s * torch.exp(lse_s - lse_all)[..., None]
    out.index_copy_(0, shared.rows, merged)
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)
