"""The engine's speculation: which sequences draft how much this step, and what came of it.

Before each step, `propose` gives every running sequence that is one token from caught up
its drafts (`seq.draft_token_ids`): from the request's `prediction` when it has one, else
from the configured method, cut to what the policy says pays (policy.plan_drafts). The
scheduler may cut them further (token budget, pages, max_tokens); the engine verifies what
ran and reports back through `record`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.request import Sequence, SequenceStatus
from config import SpeculativeConfig
from runtime.speculative.policy import StepCostModel, plan_drafts
from runtime.speculative.proposers import NgramProposer, PredictionProposer, Proposer

PREDICTION_MAX_DRAFTS = 8  # k for a request's `prediction` when no method is configured
ACCEPTANCE_DECAY = 0.7  # weight of a sequence's past acceptance per verified step


@dataclass
class SpecDecodeStats:
    """Totals since start, under vLLM's metric names' meanings."""

    num_drafts: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i


class Speculator:
    """Proposers, the step-cost model and the draft policy, for one engine."""

    def __init__(self, config: SpeculativeConfig | None) -> None:
        self.config = config
        self.method: Proposer | None = None
        if config is not None and config.method == "ngram":
            self.method = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.prediction = PredictionProposer()
        self.max_drafts = config.num_speculative_tokens if config is not None else PREDICTION_MAX_DRAFTS
        prior = config if config is not None else SpeculativeConfig()
        self.prior_acceptance = prior.prior_acceptance
        self.cost = StepCostModel(prior.draft_token_cost)
        self.stats = SpecDecodeStats(accepted_per_position=[0] * max(self.max_drafts, PREDICTION_MAX_DRAFTS))

    def propose(self, running: list[Sequence], num_prefill_tokens: int, max_model_len: int) -> None:
        """Set `draft_token_ids` on the running sequences (empty where drafting does not pay or finds nothing)."""
        candidates: list[tuple[Sequence, list[int]]] = []
        num_decodes = 0
        for seq in running:
            seq.draft_token_ids = []
            if seq.status is not SequenceStatus.RUNNING or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            num_decodes += 1
            # drafts past max_tokens or the model's length could never be emitted
            k = min(self.max_drafts, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - seq.num_tokens)
            if k <= 0:
                continue
            drafts = self.prediction.propose(seq, k) if seq.request.prediction_token_ids else []
            seq.drafts_from_prediction = bool(drafts)
            if not drafts and self.method is not None:
                drafts = self.method.propose(seq, k)
            if drafts:
                candidates.append((seq, drafts))
        if not candidates:
            return
        acceptance = [self._acceptance(seq) for seq, _ in candidates]
        counts = plan_drafts(acceptance, [len(d) for _, d in candidates], num_decodes + num_prefill_tokens,
                             num_decodes, self.cost.coefficients())
        for (seq, drafts), count in zip(candidates, counts):
            seq.draft_token_ids = drafts[:count]

    def _acceptance(self, seq: Sequence) -> float:
        return self.prior_acceptance if seq.draft_acceptance is None else seq.draft_acceptance

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step's size and wall time, for the cost model."""
        self.cost.observe(num_tokens, seconds)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """What verifying `num_drafts` drafts of `seq` gave: the first `num_accepted` were kept."""
        if num_drafts == 0:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_draft_tokens += num_accepted
        if seq.drafts_from_prediction:
            seq.request.num_accepted_prediction_tokens += num_accepted
        # each verified position is a trial until the first rejection: a run of j kept out of k drafts is
        # j successes in j trials if j == k, else j in j + 1 (accepted / drafted would undercount a)
        rate = num_accepted / (num_accepted + (num_accepted < num_drafts))
        previous = self._acceptance(seq)
        seq.draft_acceptance = ACCEPTANCE_DECAY * previous + (1.0 - ACCEPTANCE_DECAY) * rate

    def forget(self, seq: Sequence) -> None:
        """Drop a finished sequence's proposer state."""
        self.prediction.forget(seq.seq_id)
        if self.method is not None:
            self.method.forget(seq.seq_id)
