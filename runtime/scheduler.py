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

A decode may carry drafts (speculative decoding): `schedule` asks for them once room is made
(`propose`: sequences in, {seq_id: Drafts} out), so none are made for a sequence preempted
to make room. They ride in the same entry after its token, count against the budget, and are
cut to the pages that can be had without preempting; the batch carries them as placed
(`ScheduledBatch.drafts`). Only the sequence's own tokens are ever hashed.

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
from collections.abc import Callable, Mapping

from runtime.batch import Drafts, ScheduledBatch, ScheduledSequence
from runtime.fairness import FairQueue, FcfsQueue, VirtualTokenCounters
from runtime.kv_cache_manager import KVCacheManager
from runtime.request import Sequence, SequenceStatus
from runtime.scheduling_policy import scheduling_policy_class


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
        self.num_fair_preemptions = 0  # of num_preemptions: a seat taken for a tenant below its share
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up, at first scheduling
        self.prefix_cache_hits = 0  # of which found in cached pages

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

    def schedule(self, propose: Callable[[list[Sequence]], Mapping[str, Drafts]] | None = None) -> ScheduledBatch:
        """Pick this step's batch and take the pages it writes, in three phases:

        1. make room: the policy may preempt one sequence so that a tenant below its share starts;
        2. drafts: `propose(running)` gives the running sequences' drafts (asked after phase 1, so the
           sequence given back never drafts);
        3. placement: decodes (then those with drafts, cut to what fits), chunks, waiting sequences.
        """
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        preempted = False
        self.make_room()
        drafts = propose(self.running) if propose is not None else {}
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        plain = [s for s in decodes if s.seq_id not in drafts]  # one-token decodes lead the batch
        chunks = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in plain + [s for s in decodes if s.seq_id in drafts]:
            budget, preempted = self._schedule_running(batch, seq, budget, scheduled, preempted, drafts.get(seq.seq_id))
        budget = self.policy.prompt_budget(self, budget)  # what is left of the budget is prompt work
        chunk_tenants = {s.request.tenant for s in chunks}
        light = set()  # tenants behind and below their share that start a prompt before others' chunks
        if self.policy.by_tenant and chunk_tenants and not preempted:
            admitted = []
            budget = self._admit_waiting(batch, budget, scheduled, chunk_tenants, admitted)
            light = {seq.request.tenant for seq in admitted}
        if light:  # their step carries the decodes and their prompts, not the others' chunks: a short step
            chunks = [s for s in chunks if s.request.tenant in light]
        for seq in chunks:
            budget, preempted = self._schedule_running(batch, seq, budget, scheduled, preempted, None)
        if not preempted and not light:
            budget = self._admit_waiting(batch, budget, scheduled)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, seq: Sequence, budget: int, scheduled: set[str],
                          preempted: bool, proposed: Drafts | None) -> tuple[int, bool]:
        """Schedule a running sequence's next tokens (its `proposed` drafts where they fit), preempting for its
        pages if it must; returns the budget left and whether anything has been preempted this step."""
        if budget == 0 or seq.status is not SequenceStatus.RUNNING:  # out of budget, or preempted earlier
            return budget, preempted
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        drafts = self._fit_drafts(seq, budget, proposed)
        if not self.kv.has_room(seq, num_new + len(drafts)):  # most decodes write inside their last page
            if drafts and self.kv.can_allocate(seq, num_new + len(drafts)):
                batch.blocks_to_copy += self.kv.allocate(seq, num_new + len(drafts))
            else:
                drafts = []  # never preempt for a draft
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
        if drafts:
            batch.drafts[seq.seq_id] = proposed.cut(len(drafts))
        self._add_to_batch(batch, seq, num_new, drafts, scheduled)
        return budget - num_new - len(drafts), preempted

    @staticmethod
    def _fit_drafts(seq: Sequence, budget: int, proposed: Drafts | None) -> list[int]:
        """The drafts that fit this step: only for a sequence one token from caught up, within the budget."""
        if proposed is None or seq.num_tokens - seq.num_computed_tokens != 1:
            return []
        return proposed.token_ids[: budget - 1]

    @staticmethod
    def num_seats(seq: Sequence) -> int:
        """Sequences this one will be: n while its fork is pending, else 1."""
        return seq.request.params.n if seq.request.fork_pending else 1

    def first_chunk(self, seq: Sequence, budget: int) -> tuple[list, int]:
        """A waiting sequence's cached prefix pages and the tokens it would compute first, within `budget`."""
        cached = self.kv.find_cached_prefix(seq)
        return cached, min(seq.num_tokens - len(cached) * self.kv.block_size, budget)

    def make_room(self) -> None:
        """The first phase of a step (before drafts are asked for): preempt the one sequence the policy names so
        that a tenant below its share starts (under "fair"; runtime/scheduling_policy.py says when)."""
        victim = self.policy.room_victim(self)
        if victim is not None:
            self.preempt(victim)
            self.num_fair_preemptions += 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, scheduled: set[str],
                       chunk_tenants: set[str] | None = None, admitted: list[Sequence] | None = None) -> int:
        """Start waiting sequences in the queue's order while seats, budget and pages last (appended to
        `admitted` when given); returns the budget left. Given chunk_tenants (the tenants with prompt chunks
        to run this step), this is the admission before those chunks: only tenants below their share of
        seats, not among them, and with a counter no larger than theirs start (the policy's light_tenants)."""
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
            self.running.append(seq)
            if admitted is not None:
                admitted.append(seq)
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
            seq.seq_id, seq.token_ids[start : start + num_new] + drafts, start, list(self.kv.block_ids(seq)),
            len(drafts), 1 + len(drafts) if caught_up else 0,
        ))
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
        seq.status = SequenceStatus.WAITING
        self.waiting.push_front(seq)
        self.num_preemptions += 1

    def advance(self, batch: ScheduledBatch) -> list[tuple[Sequence, int, list[int]]]:
        """Credit the computed tokens; return the sequences that now sample: (sequence, first logits row, drafts).

        A sequence's rows are its entry's last num_sample_rows tokens, in batch order: one row, or
        1 + k with k drafts to verify (their KV is written; `accept_draft` credits each one kept).
        A request with n > 1 forks here, when its prompt is first fully computed: the forks
        share every page and sample from the same logits row.
        Raises RuntimeError if an entry's sequence is no longer running (the batch is stale).
        """
        running = {seq.seq_id: seq for seq in self.running}
        to_sample = []
        row = 0
        for entry in batch.entries:
            seq = running.get(entry.seq_id)
            if seq is None:
                raise RuntimeError(f"scheduled sequence {entry.seq_id!r} is not running: a batch is advanced once, "
                                   "in the step that scheduled it")
            seq.num_computed_tokens += entry.num_new_tokens - entry.num_draft_tokens
            if not entry.num_sample_rows:
                continue
            to_sample.append((seq, row, entry.draft_token_ids))
            if seq.request.fork_pending:
                to_sample += [(child, row, []) for child in self._fork(seq)]
            row += entry.num_sample_rows
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
