"""The engine's speculation: which sequences draft how much this step, and what came of it.

Each step, once the scheduler has made room, `propose` returns the drafts of the running
sequences that are one token from caught up, keyed by sequence id (`runtime.batch.Drafts`):
from the request's `prediction` when it has one, else from the configured method, cut at the
first token the sequence's grammar refuses, then to what the policy says pays
(policy.plan_drafts). The scheduler may cut them further (token budget, pages); the engine
verifies what ran and reports back through `record`. The speculator keeps every count it
learns from (per source, and per sequence until `forget`); sequences carry none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from config import SpeculativeConfig
from runtime.batch import Drafts
from runtime.request import Sequence, SequenceStatus
from runtime.speculative.policy import StepCostModel, plan_drafts
from runtime.speculative.proposers import PROPOSERS, PredictionProposer, Proposer

PREDICTION_MAX_DRAFTS = 8  # k for a request's `prediction` when no method is configured
ACCEPTANCE_DECAY = 0.85  # weight of a sequence's past acceptance per verified step (one miss costs ~15%)
SOURCE_DECAY = 0.95  # the same for a draft source over every sequence: a new sequence's starting estimate


def _averaged(estimate: float, observed: float, num_observed: int, decay: float) -> float:
    """An exponential average that starts as a plain mean: the estimate before any observation (a
    prior) weighs as one observation, so the first few observations move it fast, later ones by 1 - decay."""
    weight = max(1.0 - decay, 1.0 / (num_observed + 2))
    return (1.0 - weight) * estimate + weight * observed


@dataclass
class SequenceDrafting:
    """What one sequence's drafts have come to so far."""

    # per draft source: [first-draft acceptance estimate, verified steps behind it]; absent: none yet
    acceptance: dict[str, list] = field(default_factory=dict)
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which kept


@dataclass
class SpecDecodeStats:
    """Totals since start, under vLLM's metric names' meanings."""

    num_drafts: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i


class Speculator:
    """Proposers, the step-cost model and the draft policy, for one engine."""

    def __init__(self, config: SpeculativeConfig | None, draft: Proposer | None = None) -> None:
        """`draft`: the method's proposer when the engine built it (draft_model: it holds a model and its pages);
        else the method's proposer is made from the config (proposers.PROPOSERS), or there is none."""
        self.config = config
        self.proposer: Proposer | None = draft  # the configured method's (a request's `prediction` drafts apart)
        if draft is None and config is not None and config.method in PROPOSERS:
            self.proposer = PROPOSERS[config.method](config)
        self.prediction = PredictionProposer()
        self.max_drafts = config.num_speculative_tokens if config is not None else PREDICTION_MAX_DRAFTS
        settings = config if config is not None else SpeculativeConfig()
        self.prior = settings.prior_acceptance
        # per draft source (a Proposer's `source`), over all sequences: the rate of keeping the first
        # draft (where a new sequence starts), and per position i > 0 the rate of keeping draft i once
        # draft i - 1 was kept (exponential averages); a source starts at the prior
        self.source_acceptance: dict[str, float] = {}
        self.source_continuation: dict[str, list[float]] = {}
        self.source_counts: dict[str, list[int]] = {}  # observations behind each of those rates
        self.cost = StepCostModel(settings.draft_token_cost)
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.max_drafts)
        self.sequences: dict[str, SequenceDrafting] = {}  # seq_id -> its drafts' record, until forget

    def drafting(self, seq_id: str) -> SequenceDrafting:
        """The sequence's drafts' record (an empty one if it has verified none)."""
        return self.sequences.get(seq_id) or SequenceDrafting()

    def propose(self, running: list[Sequence], num_prefill_tokens: Callable[[], int],
                max_model_len: int) -> dict[str, Drafts]:
        """The running sequences' drafts for this step, by sequence id (a sequence drafting nothing is absent).

        `num_prefill_tokens()`: prompt tokens the step will also compute (asked only when drafting may happen).
        """
        if self.proposer is None and not any(seq.request.prediction_token_ids for seq in running):
            return {}  # nothing could draft
        decoding = [seq for seq in running
                    if seq.status is SequenceStatus.RUNNING and seq.num_tokens - seq.num_computed_tokens == 1]
        num_decodes = len(decoding)
        if not decoding:
            return {}
        num_base_tokens = num_decodes + num_prefill_tokens()
        cost = self.cost.coefficients()
        sources = (self.proposer.sources if self.proposer is not None else ())
        best = max(self._best_of(seq, sources + (self.prediction.sources if seq.request.prediction_token_ids else ()))
                   for seq in decoding)
        seeded = any(seq.params.seed is not None and not seq.params.is_greedy for seq in decoding)
        if not seeded and not plan_drafts([[best]], num_base_tokens, num_decodes, cost)[0]:
            return {}  # not even the likeliest sequence's first draft would pay (a large batch): propose nothing
        candidates: list[tuple[Sequence, Drafts]] = []
        deferred: set[str] = set()  # a batched method's: planned first, drafted after (each draft costs a forward)
        batched = getattr(self.proposer, "batched", False)
        for seq in decoding:
            # drafts past max_tokens or the model's length could never be emitted
            k = min(self.max_drafts, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens)
            if k <= 0:
                continue
            drafts = self.prediction.propose(seq, k) if seq.request.prediction_token_ids else []
            source = self.prediction.source
            if not drafts and self.proposer is not None:
                source = self.proposer.source
                if batched:
                    deferred.add(seq.seq_id)
                    candidates.append((seq, Drafts([0] * k, source)))  # placeholders: how many is planned below
                    continue
                drafts = self.proposer.propose(seq, k)
                source = self.proposer.source
            drafts = self._grammar_cut(seq, drafts, sampled=False)
            if drafts:
                candidates.append((seq, Drafts(drafts, source)))
        if not candidates:
            return {}
        gains = [self._gains(seq, drafts.source, len(drafts.token_ids)) for seq, drafts in candidates]
        extra = self.proposer.draft_cost(cost[0]) if batched else 0.0
        extra_costs = [extra if seq.seq_id in deferred else 0.0 for seq, _ in candidates] if deferred else None
        counts = plan_drafts(gains, num_base_tokens, num_decodes, cost, extra_costs)
        # a seeded sampled sequence drafts all it has: the policy's cut follows the clock, and a different
        # count would spend its seeded draws differently (the same distribution, not the same output)
        counts = [len(drafts.token_ids) if seq.params.seed is not None and not seq.params.is_greedy else count
                  for (seq, drafts), count in zip(candidates, counts)]
        proposed: dict[str, Drafts] = {}
        planned: list[tuple[Sequence, int, str]] = []
        for (seq, drafts), count in zip(candidates, counts):
            if count <= 0:
                continue
            if seq.seq_id not in deferred:
                proposed[seq.seq_id] = drafts.cut(count)
            else:
                planned.append((seq, count, drafts.source))
        if planned:
            made = self.proposer.propose_batch([seq for seq, _, _ in planned], [count for _, count, _ in planned])
            for (seq, _, source), (token_ids, probs) in zip(planned, made):
                token_ids = self._grammar_cut(seq, token_ids, sampled=probs is not None)
                if token_ids:
                    proposed[seq.seq_id] = Drafts(token_ids, source, probs)
        return proposed

    @staticmethod
    def _grammar_cut(seq: Sequence, drafts: list[int], sampled: bool) -> list[int]:
        """The drafts up to the first one the sequence's grammar refuses (it could never be kept).

        A `sampled` draft (drawn from a distribution q) keeps that refused token: verification must
        reject it by the rule (a draw from max(p - q, 0)), since cutting there would depend on the
        value q drew; what follows it is never reached. A one-hot draft is exact whatever it is: cut before.
        """
        if not drafts or seq.grammar is None:
            return drafts
        return drafts[: seq.grammar.num_valid(drafts) + sampled]

    def _gains(self, seq: Sequence, source: str, num_drafts: int) -> list[float]:
        """P(draft j kept, and every one before it), j = 1..num_drafts.

        A position the source has never reached borrows the rate of the one before it: held at the
        prior instead, a source that starts with short drafts would never try its later positions
        and so never learn they pay (a prediction copied exactly stayed at 6 of 8 drafts).
        """
        gain = self._acceptance(seq, source)
        continuation = self._continuation(source)
        counts = self.source_counts.get(source)
        gains = [gain]
        rate = self.prior
        for position in range(1, num_drafts):
            if position == 1 or (counts is not None and counts[position] > 0):
                rate = continuation[position]
            gain *= rate
            gains.append(gain)
        return gains

    def _acceptance(self, seq: Sequence, source: str) -> float:
        """The sequence's own estimate for a source once it has verified drafts from it; before that, the source's."""
        record = self.sequences.get(seq.seq_id)
        own = record.acceptance.get(source) if record is not None else None
        return own[0] if own is not None else self.source_acceptance.get(source, self.prior)

    def _best_of(self, seq: Sequence, sources: tuple[str, ...]) -> float:
        """The best first-draft rate `seq` may get from these sources (one never verified counts at the prior)."""
        return max((self._acceptance(seq, source) for source in sources), default=0.0)

    def _continuation(self, source: str) -> list[float]:
        continuation = self.source_continuation.get(source)
        if continuation is None:
            continuation = self.source_continuation[source] = [self.prior] * self.max_drafts
        return continuation

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step's size and wall time, for the cost model."""
        self.cost.observe(num_tokens, seconds)

    def record(self, seq: Sequence, source: str, num_drafts: int, num_accepted: int) -> None:
        """What verifying `num_drafts` drafts of `seq` from `source` gave: the first `num_accepted` were kept."""
        if num_drafts == 0:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        record = self.sequences.get(seq.seq_id)
        if record is None:
            record = self.sequences[seq.seq_id] = SequenceDrafting()
        record.num_draft_tokens += num_drafts
        record.num_accepted_tokens += num_accepted
        if source in self.prediction.sources:
            seq.request.num_accepted_prediction_tokens += num_accepted
        first = float(num_accepted > 0)  # the first draft: kept or not
        own = record.acceptance.setdefault(source, [self._acceptance(seq, source), 0])
        own[0] = _averaged(own[0], first, own[1], ACCEPTANCE_DECAY)
        own[1] += 1
        counts = self.source_counts.setdefault(source, [0] * self.max_drafts)
        rate = self.source_acceptance.get(source, self.prior)
        self.source_acceptance[source] = _averaged(rate, first, counts[0], SOURCE_DECAY)
        counts[0] += 1
        continuation = self._continuation(source)
        for position in range(1, min(num_drafts, num_accepted + 1)):  # draft position was reached: kept or not
            kept = float(position < num_accepted)
            continuation[position] = _averaged(continuation[position], kept, counts[position], SOURCE_DECAY)
            counts[position] += 1

    def forget(self, seq: Sequence) -> None:
        """Drop a finished sequence's proposer state and its drafts' record."""
        self.sequences.pop(seq.seq_id, None)
        self.prediction.forget(seq)
        if self.proposer is not None:
            self.proposer.forget(seq)
