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
seats can start, where the one ahead keeps its share of seats or of pages
(runtime/scheduling_policy.py, FairPolicy.room_victim, says when).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from runtime.fairness import FairQueue, FcfsQueue, VirtualTokenCounters
from runtime.kv_cache_manager import KVCacheManager
from runtime.request import Sequence, SequenceStatus
from runtime.scheduling_policy import scheduling_policy_class


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
    """Owns the waiting queue and the running list; moves sequences between them. The decisions about tenants are
    the policy's (runtime/scheduling_policy.py, registered by name: `policy`)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, policy: str = "fcfs",
                 input_weight: float = 1.0, output_weight: float = 2.0, fair_prompt_tokens: int = 0) -> None:
        policy_class = scheduling_policy_class(policy)
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.counters = VirtualTokenCounters(input_weight, output_weight)  # kept under fcfs too: the metrics
        self.policy = policy_class(self.counters, fair_prompt_tokens)
        self.waiting: FcfsQueue | FairQueue = self.policy.new_queue()
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
        """Queue a new sequence (the policy sees it arrive first: under "fair", its tenant may be lifted)."""
        request = seq.request
        if request.arrival_order < 0:
            request.arrival_order = next(self._arrivals)
        self.counters.register(request.tenant, request.tenant_weight)
        self.policy.on_arrival(self, seq)
        self.waiting.push(seq)

    def seats_by_tenant(self) -> Counter[str]:
        """Seats each tenant holds: its running sequences (a pending fork holds its n)."""
        seats: Counter[str] = Counter()
        for seq in self.running:
            seats[seq.request.tenant] += self.num_seats(seq)
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
        budget = self.policy.prompt_budget(self, budget)  # what is left of the budget is prompt work
        chunk_tenants = {s.request.tenant for s in chunks}
        light = set()  # tenants behind and below their share that start a prompt before others' chunks
        if self.policy.by_tenant and chunk_tenants and not preempted:
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
    def num_seats(seq: Sequence) -> int:
        """Sequences this one will be: n while its fork is pending, else 1."""
        return seq.request.params.n if seq.request.fork_pending else 1

    def first_chunk(self, seq: Sequence, budget: int) -> tuple[list, int]:
        """A waiting sequence's cached prefix pages and the tokens it would compute first, within `budget`."""
        cached = self.kv.find_cached_prefix(seq)
        return cached, min(seq.num_tokens - len(cached) * self.kv.block_size, budget)

    def make_room(self) -> None:
        """Before a step (and before drafts are made for it): preempt the one sequence the policy names so that a
        tenant below its share starts (under "fair"; runtime/scheduling_policy.py says when)."""
        self._room_made = True
        victim = self.policy.room_victim(self)
        if victim is not None:
            self.preempt(victim)
            self.num_fair_preemptions += 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, scheduled: set[str],
                       chunk_tenants: set[str] | None = None) -> int:
        """Start waiting sequences in the queue's order while seats, budget and pages last; returns the budget
        left. Given chunk_tenants (the tenants with prompt chunks to run this step), this is the admission
        before those chunks: only tenants below their share of seats, not among them, and with a counter no
        larger than theirs start (the policy's light_tenants)."""
        num_seats = sum(self.num_seats(s) for s in self.running)  # pending forks hold their n seats
        policy = self.policy
        seats = self.seats_by_tenant() if policy.by_tenant else Counter()
        while self.waiting and budget > 0:
            if chunk_tenants is None:
                first = policy.first_tenants(self, seats)
            else:
                first = policy.light_tenants(self, seats, chunk_tenants)
                if not first:
                    break
            seq = self.waiting.peek(first)
            request = seq.request
            if num_seats + self.num_seats(seq) > self.max_num_seqs and self.running:
                break
            cached, num_new = self.first_chunk(seq, budget)
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
            seats[request.tenant] += self.num_seats(seq)
            seq.status = SequenceStatus.RUNNING
            seq.draft_token_ids = []
            self.running.append(seq)
            num_seats += self.num_seats(seq)
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
        return self.policy.pick_victim(self, candidates) if candidates else asking

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
