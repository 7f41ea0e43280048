"""A request and its sequences: the units the scheduler moves and the pages belong to.

A `Request` is what a caller submitted: a prompt, sampling params, a cache salt. It owns
`n` `Sequence`s (one per sample). Every sequence follows one rule: its
`num_computed_tokens` catches up to `num_tokens` (prompt + outputs so far). Prefill,
chunked prefill, a prefix hit and decode are that rule seen at different moments.
With n > 1, the request starts with one sequence; when its prompt is computed, it forks
into n, the forks sharing the prompt's pages.
"""

from __future__ import annotations

import enum

import torch

from runtime.detokenizer import IncrementalDetokenizer
from runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One caller request: prompt, params, salt, and its sequences (samples)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: bytes | None,
        num_shared_blocks: int = 0,
        pin_id: str | None = None,
        grammar=None,
        prediction_token_ids: list[int] | None = None,
        min_tokens_held_back: list[int] | None = None,
        tenant: str = "default",
        tenant_weight: float = 1.0,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.cache_salt = cache_salt
        self.num_shared_blocks = num_shared_blocks  # leading blocks hashed without the salt (shared prefix)
        self.tenant = tenant  # who is served: fair scheduling's party (runtime/fairness.py)
        self.tenant_weight = tenant_weight  # the tenant's share weight (its plan's), > 0
        self.priority = priority  # vLLM's field: lower first, among the tenant's own requests (fair scheduling)
        self.arrival_order = -1  # set by the scheduler when first queued
        self.pin_id = pin_id  # set for a pinned-prefix prefill: its full pages stay held when it ends
        self.grammar = grammar  # grammar.CompiledGrammar of params.structured_outputs, compiled before queueing
        bias = params.logit_bias
        # params.logit_bias as (token ids int64 [k], biases float32 [k]): made once, added every step
        self.logit_bias = (torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()))) if bias else None
        # int64 [m] ascending: the token ids that cannot be sampled before params.min_tokens outputs; None: none
        self.min_tokens_held_back = torch.tensor(min_tokens_held_back, dtype=torch.long) if min_tokens_held_back \
            else None
        self.prediction_token_ids = prediction_token_ids or []  # OpenAI's `prediction`, tokenized: drafts
        self.num_accepted_prediction_tokens = 0  # predicted tokens kept by verification (all samples)
        self.num_cached_tokens: int | None = None  # prefix hit at first scheduling
        self.num_cache_written_tokens = 0  # prompt tokens in pages this request put into the prefix cache
        self.sequences: list[Sequence] = []
        self.fork_pending = params.n > 1  # n > 1 and not yet forked: it runs as one sequence until then
        self.aborted = False
        self.timeline = None  # runtime.timeline.RequestTimeline while the engine traces requests

    @property
    def finished(self) -> bool:
        complete = self.aborted or len(self.sequences) == self.params.n
        return complete and all(s.is_finished for s in self.sequences)


class Sequence:
    """One sample stream of a request: its tokens, progress, sampling state and stop state."""

    def __init__(self, request: Request, index: int, token_ids: list[int], detokenizer: IncrementalDetokenizer) -> None:
        self.request = request
        self.index = index
        self.seq_id = request.request_id if index == 0 else f"{request.request_id}#{index}"
        self.token_ids = token_ids  # prompt + outputs
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_charged_prompt_tokens = 0  # prompt tokens counted as the tenant's service (never twice)
        self.block_hashes: list[bytes] = []  # of full blocks of token_ids, chained and salted
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, float]] = []  # per output token: chosen + top-k
        self.cumulative_logprob = 0.0
        self.generator = self._make_generator(request.params.seed, index)
        self.num_emitted_tokens = 0  # output tokens already reported by step()
        self.penalty_counts = None  # sampler.PenaltyCounts, made on the first penalised step
        # grammar.GrammarMatcher: where this sample is in its grammar. Preemption keeps it: the
        # tokens are kept too, so the matcher stays in step with them
        self.grammar = request.grammar.new_matcher() if request.grammar is not None and index == 0 else None

    def append_token(self, token_id: int) -> None:
        """Add a sampled token (and count it for penalties, if they are being counted)."""
        self.token_ids.append(token_id)
        if self.penalty_counts is not None:
            self.penalty_counts.add(token_id)

    @staticmethod
    def _make_generator(seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator().manual_seed((seed * 1_000_003 + index) & 0xFFFF_FFFF_FFFF)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int, detokenizer: IncrementalDetokenizer) -> Sequence:
        """A new sample of the same request, at the same point, with its own sampling state."""
        child = Sequence(self.request, index, list(self.token_ids), detokenizer)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_charged_prompt_tokens = self.num_charged_prompt_tokens  # the shared prompt was charged once
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        if self.penalty_counts is not None:
            child.penalty_counts = self.penalty_counts.copy()
        if self.grammar is not None:
            child.grammar = self.grammar.copy()
        return child

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id!r}, {self.num_computed_tokens}/{self.num_tokens}, {self.status.value})"
