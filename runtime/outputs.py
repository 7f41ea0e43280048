"""What the engine hands back: per request, per sample, what is new this step.

step() outputs are deltas (new_*), so a step costs the same at token 10 and token 10,000;
a request's final output (finished=True) also carries the whole text, tokens and logprobs,
which is what generate() returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One output token with its text (its exact share of the output text) and its logprobs."""

    token_id: int
    text: str
    logprobs: dict[int, float]  # the chosen token first, then the top-k


@dataclass
class CompletionOutput:
    """One sample of a request so far."""

    index: int
    text: str  # the whole text (stop strings cut): on the request's final output, else ""
    token_ids: list[int]  # all output tokens: on the request's final output, else []
    new_text: str = ""  # text released this step (held back while it may start a stop string)
    new_token_ids: list[int] = field(default_factory=list)  # tokens sampled this step
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # final output: per token, chosen first, then top-k
    new_logprobs: list[TokenLogprob] | None = None  # tokens whose text was released this step, with logprobs
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: its samples, and how much of its prompt was cached."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool
    num_accepted_prediction_tokens: int = 0  # of which verification kept (all samples)
    num_cache_written_tokens: int = 0  # prompt tokens in pages this request put into the prefix cache

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
