"""The one validation of a caller's request, from what never changes after start.

The engine holds one (`Engine.request_builder`); a front door that routes to remote workers
builds one from a worker's limits (`RemoteModel`), so a bad request gets the same error before it crosses
the network.

Safe from any thread by design: a builder reads only its frozen limits and its tokenizer's
encode, and its grammar compiler locks its own cache. The service builds requests on the
event loop; the engine builds its own (pins, `add_request`) on its thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.grammar import CompiledGrammar, GrammarCompiler
from runtime.request import Request
from runtime.sampling_params import InvalidRequestError, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """The sizes a request is checked against: the model's and the page pool's."""

    vocab_size: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    num_schedulable_blocks: int  # pages one request may use: the pool less the pin budget
    eos_token_ids: tuple[int, ...] = ()  # the model's and the tokenizer's end tokens (grammars end on them)


class RequestBuilder:
    """Tokenize, check, and build `Request`s (see `prepare_request`)."""

    def __init__(self, tokenizer, limits: RequestLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        # the structured-output compiler for this tokenizer (its vocabulary index: warm_up(), or the first compile)
        self.grammars = GrammarCompiler(tokenizer, limits.vocab_size, list(limits.eos_token_ids))

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Prompt token ids: a string is encoded (BOS as the tokenizer says); token ids pass through."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | bytes | None = None,
        shared_prefix_len: int = 0,
        pin_id: str | None = None,
        prompt_param: str = "prompt",
        grammar: CompiledGrammar | None = None,
        prediction: str | list[int] | None = None,
        tenant: str = "default",
        tenant_weight: float = 1.0,
        priority: int = 0,
    ) -> Request:
        """Validate a request once and build it.

        Raises InvalidRequestError: `n` past max_num_seqs (param "n"), an empty prompt or token
        ids outside the vocabulary (param `prompt_param`), or prompt + max_tokens past the
        context or the page pool (code "context_length_exceeded", param `prompt_param`).

        `cache_salt` separates prefix-cache chains (a tenant's). The first
        `shared_prefix_len` tokens, if an operator marked them as shared across tenants,
        are cached without the salt (whole blocks only).

        A constrained request (params.structured_outputs) takes its `grammar` compiled already
        (the service compiles off the event loop); without one it is compiled here. A
        constraint that does not compile raises InvalidRequestError naming its field.

        `prediction` (OpenAI's Predicted Outputs: text, or token ids) is the output the caller
        expects; it drafts for speculative decoding and never changes the output.

        `tenant`, its share `tenant_weight` and `priority` (lower first) are what fair scheduling
        orders by (runtime/fairness.py); a priority that is not an integer raises InvalidRequestError.
        """
        limits = self.limits
        params = params or SamplingParams()
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", param="priority")
        if not tenant_weight > 0:
            raise InvalidRequestError(f"a tenant's weight must be > 0, got {tenant_weight}", param="tenant_weight")
        if params.n > limits.max_num_seqs:
            raise InvalidRequestError(f"n is {params.n}, but this server runs at most {limits.max_num_seqs} "
                                      "sequences at once (engine.max_num_seqs)", param="n")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        # the length first: a prompt far past the context is refused without reading its ids (a megabyte of
        # text is 300,000 of them, 40 ms of Python under the GIL the engine thread needs)
        self.check_fits(len(token_ids), params, prompt_param)
        vocab_size = limits.vocab_size
        if not ids_in_vocab(token_ids, vocab_size):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})", param=prompt_param)
        if params.logit_bias and any(t >= vocab_size for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab_size})", param="logit_bias")
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        predicted = self.tokenizer.encode(prediction, add_special_tokens=False) if isinstance(prediction, str) \
            else list(prediction or [])
        if not ids_in_vocab(predicted, vocab_size):
            raise InvalidRequestError(f"prediction token ids must be integers in [0, {vocab_size})", param="prediction")
        salt = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
        held_back = None  # what min_tokens keeps from being sampled early: stop token ids, and EOS unless ignored
        if params.min_tokens:
            held_back = set(params.stop_token_ids) | (set() if params.ignore_eos else set(limits.eos_token_ids))
            held_back = sorted(t for t in held_back if 0 <= t < vocab_size)
        return Request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, salt,
                       num_shared_blocks=min(shared_prefix_len, len(token_ids)) // limits.block_size, pin_id=pin_id,
                       grammar=grammar if params.structured_outputs is not None else None,
                       prediction_token_ids=predicted, min_tokens_held_back=held_back, tenant=tenant,
                       tenant_weight=tenant_weight, priority=priority)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams, prompt_param: str = "prompt") -> None:
        """Raise InvalidRequestError unless prompt + max_tokens fits the context and the page pool."""
        limits = self.limits
        total = num_prompt_tokens + params.max_tokens
        if total > limits.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {limits.max_model_len} tokens; the request needs {total} "
                f"({num_prompt_tokens} in the prompt, {params.max_tokens} to generate)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        pages = -(-total // limits.block_size)
        if pages > limits.num_schedulable_blocks:
            raise InvalidRequestError(
                f"the request needs {pages} KV pages ({total} tokens) but at most {limits.num_schedulable_blocks} "
                "are free for one request",
                param=prompt_param,
                code="context_length_exceeded",
            )


def ids_in_vocab(token_ids: list, vocab_size: int) -> bool:
    """Whether every entry is an int (not a bool) in [0, vocab_size); C loops, not a Python one."""
    if not token_ids:
        return True
    if set(map(type, token_ids)) != {int}:  # type() is exact: a bool is not an int here
        return False
    return min(token_ids) >= 0 and max(token_ids) < vocab_size
