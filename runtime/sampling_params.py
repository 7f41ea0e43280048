"""Per-request sampling settings, checked when made (vLLM's names, OpenAI's meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.errors import InvalidRequestError
from runtime.structured_outputs import StructuredOutputs

__all__ = ["GREEDY_TEMPERATURE", "MAX_N", "InvalidRequestError", "SamplingParams", "StructuredOutputs"]


GREEDY_TEMPERATURE = 1e-5  # at or below this, sampling is argmax
MAX_N = 128  # samples per request (OpenAI's limit)
MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI bounds it


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request (all its `n` samples)."""

    n: int = 1
    max_tokens: int = 16  # 0: nothing is generated; the request ends at once with finish_reason "length"
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled, nor stop strings match, before this many
    temperature: float = 1.0
    top_p: float = 1.0  # 0 keeps only the most probable token (as OpenAI's API accepts it)
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's plus the top k
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    structured_outputs: StructuredOutputs | None = None  # the output's grammar, if constrained

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._check()

    def _check(self) -> None:
        def bad(param: str, why: str) -> None:
            raise InvalidRequestError(f"{param} {why}", param=param)

        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            bad("max_tokens", f"must be an integer >= 0, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not 0.0 <= self.top_p <= 1.0:
            bad("top_p", f"must be in [0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must hold non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or token_id < 0:
                    bad("logit_bias", f"keys must be token ids (integers >= 0), got {token_id!r}")
                if not isinstance(bias, int | float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    bad("logit_bias", f"values must be numbers in [-100, 100], got {bias!r} for token {token_id}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
