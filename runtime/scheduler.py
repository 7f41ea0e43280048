"""Iteration-level scheduling: which tokens of which sequences run in the next step.

Every sequence follows one rule: compute tokens until num_computed_tokens == num_tokens.
Each step, under a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):

  1. running sequences with one token to go (decodes), oldest first;
  2. running sequences with more to go (prefill chunks), oldest first, each chunk cut to
     the budget left, so a long prompt never stalls the decodes (under "fair", waiting
     sequences of tenants below their share of seats whose counters are not ahead of the
     chunks' tenants start before these chunks: a light tenant's prompt does not wait
     behind a flooding tenant's long prompts; and a step where such a tenant starts leaves
     out the other tenants' chunks and new prompts, so it lasts the decodes and the light
     prompt, not a full budget of the flood's prompts: its first token comes a short step
     after the step running when it arrived);
  3. waiting sequences, in the waiting queue's order (runtime/fairness.py: first come first
     served, or fair across tenants by virtual token counters), each starting after its
     longest cached prefix (pages scheduled earlier in the same step count: identical
     prefixes arriving together are computed once); none are admitted in a step that had to
     preempt.

A decode may carry drafts (speculative decoding: seq.draft_token_ids, set before the step):
they ride in the same entry after its token, count against the budget, and are cut to the
pages that can be had without preempting; only the sequence's own tokens are ever hashed.

When the pool cannot cover a running sequence's tokens, the newest running sequence not
yet scheduled this step (under "fair": of the tenant furthest ahead, if it has one) is
preempted: its pages go back, its computed count drops to 0, and it waits at the head of
its line to be recomputed (its tokens are kept, so its output does not change). If that
sequence is the one asking, it preempts itself. Under "fair", a step may also begin by
preempting one sequence of the tenant furthest ahead so that a tenant below its share of
seats can start, where the one ahead keeps its share of seats or of pages (fairness.py says
when).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from runtime.fairness import SCHEDULING_POLICIES, FairQueue, FcfsQueue, VirtualTokenCounters
from runtime.kv_cache_manager import KVCacheManager
from runtime.request import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step, as plain data: what the runner computes and which rows it samples.

        token_ids:  | to compute (prompt chunk, or the last token) | drafts (k) |
        positions:    start_position ...
        logits rows:  the last num_sample_rows tokens (0 mid-prompt; 1 + k once caught up)
    """

    seq_id: str
    token_ids: list[int]  # this step's input: tokens to compute, then the drafts to verify
    start_position: int  # position of token_ids[0]
    block_table: list[int]  # physical pages covering every position written (the manager's list: read only)
    num_draft_tokens: int  # the last ones of token_ids are drafts
    num_sample_rows: int  # logits rows this sequence gets: its last num_sample_rows tokens

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class ScheduledBatch:
    """One step's work: decodes first (one token each, then a verification's drafts), then prompt chunks.

    Every token of the first `num_decodes` entries is a decode query: a verification's k + 1
    tokens attend as k + 1 decodes of growing context, the same computation a decode without
    drafts would make at each position (so greedy tokens cannot change with speculation).
    """

    entries: list[ScheduledSequence] = field(default_factory=list)
    num_decodes: int = 0  # leading entries computed as decodes
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward

    @property
    def is_empty(self) -> bool:
        return not self.entries

    @property
    def num_new_tokens(self) -> list[int]:
        return [len(e.token_ids) for e in self.entries]

    @property
    def num_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.entries)


class Scheduler:
    """Owns the waiting queue and the running list; moves sequences between them."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, policy: str = "fcfs",
                 input_weight: float = 1.0, output_weight: float = 2.0, fair_prompt_tokens: int = 0) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.fair_prompt_tokens = fair_prompt_tokens  # under "fair" with tenants sharing: prompt tokens a step (0: no cap)
        self.counters = VirtualTokenCounters(input_weight, output_weight)  # kept under fcfs too: the metrics
        self.waiting: FcfsQueue | FairQueue = FairQueue(self.counters) if policy == "fair" else FcfsQueue()
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()  # arrival order of requests (a preempted one keeps its place)
        self._room_made = False  # make_room ran for the coming step
        self.num_fair_preemptions = 0  # of num_preemptions: a seat taken for a tenant below its share
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up, at first scheduling
        self.prefix_cache_hits = 0  # of which found in cached pages
        self._scheduled: list[Sequence] = []  # the last schedule()'s sequences, in its entries' order

    @property
    def scheduled_sequences(self) -> list[Sequence]:
        """The last schedule()'s sequences, in its entries' order (until advance())."""
        return list(self._scheduled)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Under "fair", a tenant with nothing waiting is lifted to the floor of the
        tenants that have (or, if none has, of those running): waiting banks no credit."""
        request = seq.request
        tenant = request.tenant
        if request.arrival_order < 0:
            request.arrival_order = next(self._arrivals)
        self.counters.register(tenant, request.tenant_weight)
        if self.policy == "fair" and not self.waiting.depth(tenant):
            self.counters.lift(tenant, self.waiting.tenants() or self.seats_by_tenant())
        self.waiting.push(seq)

    def seats_by_tenant(self) -> Counter[str]:
        """Seats each tenant holds: its running sequences (a pending fork holds its n)."""
        seats: Counter[str] = Counter()
        for seq in self.running:
            seats[seq.request.tenant] += self._num_seats(seq)
        return seats

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_pending_prompt_tokens(self) -> int:
        """Prompt tokens the next step may compute (running chunks, then the queue), within the budget."""
        pending = sum(s.num_tokens - s.num_computed_tokens - 1 for s in self.running)
        pending += sum(s.num_tokens for s in self.waiting)
        return min(pending, self.max_num_batched_tokens)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's batch and take the pages it writes (drafts included, where they fit)."""
        batch = ScheduledBatch()
        self._scheduled = []
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        preempted = False
        if not self._room_made:  # the engine calls make_room before drafting; direct callers get it here
            self.make_room()
        self._room_made = False
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        plain = [s for s in decodes if not s.draft_token_ids]  # one-token decodes lead the batch
        chunks = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in plain + [s for s in decodes if s.draft_token_ids]:
            budget, preempted = self._schedule_running(batch, seq, budget, scheduled, preempted)
        if self.policy == "fair" and 0 < self.fair_prompt_tokens < budget and self._tenants_share():
            budget = self.fair_prompt_tokens  # what is left of the budget is prompt work: capped
        chunk_tenants = {s.request.tenant for s in chunks}
        light = set()  # tenants behind and below their share that start a prompt before others' chunks
        if self.policy == "fair" and chunk_tenants and not preempted:
            num_entries = len(batch.entries)
            budget = self._admit_waiting(batch, budget, scheduled, chunk_tenants)
            light = {seq.request.tenant for seq in self._scheduled[num_entries:]}
        if light:  # their step carries the decodes and their prompts, not the others' chunks: a short step
            chunks = [s for s in chunks if s.request.tenant in light]
        for seq in chunks:
            budget, preempted = self._schedule_running(batch, seq, budget, scheduled, preempted)
        if not preempted and not light:
            budget = self._admit_waiting(batch, budget, scheduled)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, seq: Sequence, budget: int, scheduled: set[str],
                          preempted: bool) -> tuple[int, bool]:
        """Schedule a running sequence's next tokens (its drafts where they fit), preempting for its pages
        if it must; returns the budget left and whether anything has been preempted this step."""
        if budget == 0 or seq.status is not SequenceStatus.RUNNING:  # out of budget, or preempted earlier
            return budget, preempted
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        drafts = self._fit_drafts(seq, budget)
        if not self.kv.has_room(seq, num_new + len(drafts)):  # most decodes write inside their last page
            if drafts and self.kv.can_allocate(seq, num_new + len(drafts)):
                batch.blocks_to_copy += self.kv.allocate(seq, num_new + len(drafts))
            else:
                drafts = seq.draft_token_ids = []  # never preempt for a draft
                while not self.kv.can_allocate(seq, num_new):
                    victim = self._pick_victim(seq, scheduled)
                    self.preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    return budget, preempted
                batch.blocks_to_copy += self.kv.allocate(seq, num_new)
        # only tokens that are the sequence's own are hashed: a page holding a draft never is
        self.kv.cache_full_blocks(seq, seq.num_computed_tokens + num_new)
        self._add_to_batch(batch, seq, num_new, drafts, scheduled)
        return budget - num_new - len(drafts), preempted

    def _fit_drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts that fit this step: only for a sequence one token from caught up, within the budget."""
        drafts = seq.draft_token_ids
        if not drafts:
            return drafts
        if seq.num_tokens - seq.num_computed_tokens != 1:
            seq.draft_token_ids = []
            return []
        if len(drafts) > budget - 1:
            drafts = seq.draft_token_ids = drafts[: budget - 1]
        return drafts

    @staticmethod
    def _num_seats(seq: Sequence) -> int:
        """Sequences this one will be: n while its fork is pending, else 1."""
        return seq.request.params.n if seq.request.fork_pending else 1

    def _first_chunk(self, seq: Sequence, budget: int) -> tuple[list, int]:
        """A waiting sequence's cached prefix pages and the tokens it would compute first, within `budget`."""
        cached = self.kv.find_cached_prefix(seq)
        return cached, min(seq.num_tokens - len(cached) * self.kv.block_size, budget)

    def _share(self, tenant: str, active: set[str]) -> float:
        """The tenant's weighted share of max_num_seqs among the active tenants."""
        weights = self.counters.weights
        return self.max_num_seqs * weights[tenant] / sum(weights[t] for t in active | {tenant})

    def _below_share(self, seats: Counter[str]) -> dict[str, float]:
        """Waiting tenants that could start one more sequence and stay within their share of seats, each with
        the part of its share it holds (the queue's tie-break: of two tenants level on counters, the one
        further below its share starts first)."""
        if self.policy != "fair":
            return {}
        waiting = self.waiting.tenants()
        active = self._active_tenants(seats)
        shares = {t: self._share(t, active) for t in waiting}
        return {t: seats[t] / share for t, share in shares.items() if seats[t] + 1 <= share}

    def _tenants_share(self) -> bool:
        """Whether more than one tenant holds seats or waits (stops at the second one found)."""
        tenants = set(self.waiting.tenants())
        if len(tenants) > 1:
            return True
        for seq in self.running:
            tenants.add(seq.request.tenant)
            if len(tenants) > 1:
                return True
        return False

    def _active_tenants(self, seats: Counter[str]) -> set[str]:
        """Tenants holding seats or with sequences waiting."""
        return set(seats) | set(self.waiting.tenants())

    def make_room(self) -> None:
        """Under "fair", before a step (and before drafts are made for it): preempt one sequence of the
        tenant furthest ahead if the next waiting sequence cannot start otherwise (its first chunk's pages
        counted after those this step's decodes take).

        Only where the waiting tenant stays within its share of seats by starting, its counter is
        no larger than the victim tenant's, and the victim tenant keeps at least its own share of seats
        or of the pool's pages: two backlogged tenants never take seats or pages back and forth (shares
        need not be whole numbers). Pages count because they bind first when prompts are long: a
        flood of 640-token requests fills the pool with fewer sequences than its share of seats, and a
        light tenant then waited for one of them to finish (traced through the server, issue 36). A
        tie takes the seat: a tenant back from idle is lifted to the others' floor, and waiting one step
        for their counters to move on cost it a whole step. The victim is that tenant's latest-arrived
        running request, so a request already preempted once (it keeps its place in arrival order) is
        not the next one taken again.
        """
        self._room_made = True
        if self.policy != "fair" or not self.waiting:
            return
        seats = self.seats_by_tenant()
        head = self.waiting.peek(self._below_share(seats))
        tenant = head.request.tenant
        needed = self._num_seats(head)
        if sum(seats.values()) + needed <= self.max_num_seqs:
            cached, first_chunk = self._first_chunk(head, max(1, self.max_num_batched_tokens - len(self.running)))
            decode_pages = sum(1 for s in self.running
                               if s.num_tokens - s.num_computed_tokens == 1 and not self.kv.has_room(s, 1))
            if self.kv.can_allocate(head, first_chunk, cached, reserve=decode_pages):
                return  # it starts this step without anyone's seat
        active = self._active_tenants(seats)
        if seats[tenant] + needed > self._share(tenant, active):
            return
        counters = self.counters.counters
        pages = Counter()
        for seq in self.running:
            pages[seq.request.tenant] += len(self.kv.block_ids(seq))
        victims = {}
        for t, held in seats.items():
            if t == tenant or counters[t] < counters[tenant]:
                continue
            victim = max((s for s in self.running if s.request.tenant == t and not s.request.fork_pending),
                         key=lambda s: s.request.arrival_order, default=None)
            if victim is None:
                continue
            page_share = self.kv.pool.num_blocks * self._share(t, active) / self.max_num_seqs
            if held - 1 >= self._share(t, active) or pages[t] - len(self.kv.block_ids(victim)) >= page_share:
                victims[t] = victim
        if not victims:
            return
        self.preempt(victims[max(victims, key=lambda t: counters[t])])
        self.num_fair_preemptions += 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, scheduled: set[str],
                       chunk_tenants: set[str] | None = None) -> int:
        """Start waiting sequences in the queue's order while seats, budget and pages last; returns the budget
        left. Given chunk_tenants (the tenants with prompt chunks to run this step), this is the admission
        before those chunks: only tenants below their share of seats, not among them, and with a counter no
        larger than theirs start (each start is charged at once, so a tenant goes first only while it is
        behind: it never starves the others' prompts; a tolerance of one step's budget did, measured)."""
        num_seats = sum(self._num_seats(s) for s in self.running)  # pending forks hold their n seats
        seats = self.seats_by_tenant() if self.policy == "fair" else Counter()
        counters = self.counters.counters
        chunks_floor = min((counters[t] for t in chunk_tenants or ()), default=0.0)
        while self.waiting and budget > 0:
            first = self._below_share(seats)
            if chunk_tenants is not None:
                first = {t: held for t, held in first.items() if t not in chunk_tenants and counters[t] <= chunks_floor}
                if not first:
                    break
            seq = self.waiting.peek(first)
            request = seq.request
            if num_seats + self._num_seats(seq) > self.max_num_seqs and self.running:
                break
            cached, num_new = self._first_chunk(seq, budget)
            num_cached = len(cached) * self.kv.block_size
            if not self.kv.can_allocate(seq, num_new, cached):
                break
            batch.blocks_to_copy += self.kv.allocate(seq, num_new, cached)
            self.kv.cache_full_blocks(seq, seq.num_computed_tokens + num_new)  # later arrivals can hit them
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_cached
            self.waiting.pop(first)
            seats[request.tenant] += self._num_seats(seq)
            seq.status = SequenceStatus.RUNNING
            seq.draft_token_ids = []
            self.running.append(seq)
            num_seats += self._num_seats(seq)
            self._add_to_batch(batch, seq, num_new, [], scheduled)
            budget -= num_new
        return budget

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, num_new: int, drafts: list[int],
                      scheduled: set[str]) -> None:
        start = seq.num_computed_tokens
        caught_up = start + num_new == seq.num_tokens
        # prompt tokens computed for the first time are the tenant's service (a recomputation is not),
        # charged as they are scheduled (as VTC does): the next admission in this step already sees them
        # (only tokens computed: a prefix hit's tokens are below `start`)
        end = min(start + num_new, seq.num_prompt_tokens)
        fresh = end - max(start, seq.num_charged_prompt_tokens)
        if fresh > 0:
            self.counters.charge(seq.request.tenant, num_input=fresh)
        seq.num_charged_prompt_tokens = max(seq.num_charged_prompt_tokens, end)
        if num_new == 1 and batch.num_decodes == len(batch.entries):  # a decode, with or without drafts
            batch.num_decodes += 1
        batch.entries.append(ScheduledSequence(
            seq.seq_id, seq.token_ids[start : start + num_new] + drafts, start, self.kv.block_ids(seq),
            len(drafts), 1 + len(drafts) if caught_up else 0,
        ))
        self._scheduled.append(seq)
        scheduled.add(seq.seq_id)

    def _pick_victim(self, asking: Sequence, scheduled: set[str]) -> Sequence:
        """The newest running sequence not scheduled this step (under "fair": the furthest-ahead tenant's first)."""
        candidates = [s for s in reversed(self.running) if s is not asking and s.seq_id not in scheduled]
        if not candidates:
            return asking
        if self.policy == "fair":
            counters = self.counters.counters
            return max(candidates, key=lambda s: (counters[s.request.tenant], s.request.arrival_order))
        return candidates[0]

    def preempt(self, seq: Sequence) -> None:
        """Give back the sequence's pages; it will be recomputed from its tokens."""
        self.kv.free(seq)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.push_front(seq)
        self.num_preemptions += 1

    def advance(self, batch: ScheduledBatch) -> list[tuple[Sequence, int, list[int]]]:
        """Credit the computed tokens; return the sequences that now sample: (sequence, first logits row, drafts).

        A sequence's rows are its entry's last num_sample_rows tokens, in batch order: one row, or
        1 + k with k drafts to verify (their KV is written; `accept_draft` credits each one kept).
        A request with n > 1 forks here, when its prompt is first fully computed: the forks
        share every page and sample from the same logits row.
        """
        to_sample = []
        row = 0
        for seq, entry in zip(self._scheduled, batch.entries):
            seq.num_computed_tokens += entry.num_new_tokens - entry.num_draft_tokens
            if not entry.num_sample_rows:
                continue
            drafts = entry.token_ids[entry.num_new_tokens - entry.num_draft_tokens :]
            to_sample.append((seq, row, drafts))
            if seq.request.fork_pending:
                to_sample += [(child, row, []) for child in self._fork(seq)]
            row += entry.num_sample_rows
        self._scheduled = []
        return to_sample

    def served_output(self, seq: Sequence) -> None:
        """A token was generated for the sequence: its tenant's service."""
        self.counters.charge(seq.request.tenant, num_output=1)

    def tenant_stats(self) -> dict[str, dict]:
        """Per tenant: virtual counter, tokens served (prompt computed, generated), sequences waiting and running."""
        counters = self.counters
        waiting = Counter(s.request.tenant for s in self.waiting)
        running = Counter(s.request.tenant for s in self.running)
        return {tenant: {"virtual_tokens": counters.counters[tenant], "weight": counters.weights[tenant],
                         "served_input_tokens": counters.served_input[tenant],
                         "served_output_tokens": counters.served_output[tenant],
                         "num_waiting": waiting[tenant], "num_running": running[tenant]}
                for tenant in counters.counters}

    def accept_draft(self, seq: Sequence) -> None:
        """A verified draft is kept: its KV, written this step, now counts as computed."""
        seq.num_computed_tokens += 1

    def release_rejected(self, seq: Sequence) -> None:
        """After verification: pages wholly past the sequence's tokens (rejected drafts only) go back."""
        seq.draft_token_ids = []
        if seq.status is SequenceStatus.RUNNING:
            self.kv.trim(seq)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        request = parent.request
        children = []
        for index in range(1, request.params.n):
            child = parent.fork(index, parent.detokenizer.copy())
            self.kv.fork(parent, child)
            request.sequences.append(child)
            self.running.append(child)
            children.append(child)
        request.fork_pending = False
        return children

    def finish(self, seq: Sequence, reason: str) -> None:
        """End the sequence and return its pages at once."""
        was_running = seq.status is SequenceStatus.RUNNING
        if was_running:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if was_running and seq.request.pin_id is not None and reason != "abort":
            self.kv.pin(seq.request.pin_id, seq)  # a pinned prefix keeps its full pages
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
