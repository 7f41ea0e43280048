"""What one step passes between its parts, as plain data: the drafts proposed, and the batch scheduled.

    Speculator.propose  -> {seq_id: Drafts}                 (before placement: what each decode could verify)
    Scheduler.schedule  -> ScheduledBatch                   (what runs: entries, page copies, the drafts placed)
    ModelRunner.execute <- ScheduledBatch                   (reads only this: no sequence, no live list)
    Engine._sample      -> {seq_id: SampledTokens}          (the step's new tokens; nothing appended yet)
    Engine._update      <- {seq_id: SampledTokens}          (appends them, stop checks, kept drafts' KV credited)

Nothing here points back into the scheduler's or the KV manager's state: an entry's block table
is a copy, so whatever holds a batch cannot change (or be changed by) the pages' bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Drafts:
    """A sequence's draft tokens for one step, where they came from, and what they were drawn from."""

    token_ids: list[int]
    source: str  # the Proposer source that made them (acceptance is kept per source)
    # float32 [len(token_ids) or more, vocab]: the distribution each draft was drawn from (a sampling draft
    # model); None: one-hot drafts (n-gram, suffix, prediction, a greedy draft model)
    probs: torch.Tensor | None = None

    def cut(self, num_drafts: int) -> Drafts:
        """The first `num_drafts` of them (the probs rows past those are never read)."""
        return self if num_drafts >= len(self.token_ids) else Drafts(self.token_ids[:num_drafts], self.source,
                                                                      self.probs)


@dataclass(slots=True)
class SampledTokens:
    """What one sequence's rows gave this step: its new tokens (one, or a verification's run), in order."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per token: chosen first, then the top-k (None: not asked)
    num_accepted_drafts: int = 0  # the first this many tokens are kept drafts (their KV is already written)


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
    block_table: list[int]  # physical pages covering every position written (a copy, taken when scheduled)
    num_draft_tokens: int  # the last ones of token_ids are drafts
    num_sample_rows: int  # logits rows this sequence gets: its last num_sample_rows tokens

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]


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
    drafts: dict[str, Drafts] = field(default_factory=dict)  # seq_id -> the drafts its entry carries, as placed

    @property
    def is_empty(self) -> bool:
        return not self.entries

    @property
    def num_new_tokens(self) -> list[int]:
        return [len(e.token_ids) for e in self.entries]

    @property
    def num_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.entries)
