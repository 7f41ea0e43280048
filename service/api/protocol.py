"""OpenAI request bodies as strict msgspec Structs, and their mapping onto SamplingParams.

Unknown fields are rejected by name; types are strict (no "5" for 5), with two allowances
OpenAI's own spec makes: `null` in an optional field means its default, and a whole number
sent as a float (`"seed": 7.0`) is that integer (`7.5` is still a 400). vLLM's extra
sampling fields (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids) are accepted.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from runtime.sampling_params import InvalidRequestError, SamplingParams

MAX_STOP_STRINGS = 4


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by chat and completion requests. Every optional field may be null: its default."""

    integer_fields: ClassVar[tuple[str, ...]] = ("n", "max_tokens", "seed", "top_k")
    token_id_fields: ClassVar[tuple[str, ...]] = ("stop_token_ids",)  # lists of integers
    prompt_param: ClassVar[str] = "prompt"  # the field a too-long prompt is reported under

    model: str
    max_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    # prefix caching: a client salt splits the tenant's cache further; a prompt_cache_key
    # that an operator marked as shared selects that shared prefix
    cache_salt: str | None = None
    prompt_cache_key: str | None = None

    def __post_init__(self) -> None:
        self.n = 1 if self.n is None else self.n
        self.stream = bool(self.stream)
        self.ignore_eos = bool(self.ignore_eos)
        self.include_stop_str_in_output = bool(self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """SamplingParams for this body; max_tokens defaults to the rest of the context."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop")
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:  # the rest of the context; a prompt that fills it fails the engine's one check
            max_tokens = max(1, max_model_len - num_prompt_tokens)
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "logprobs": self.requested_logprobs(),
        }
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            **{k: v for k, v in given.items() if v is not None},
        )


class ChatCompletionRequest(SamplingFields, forbid_unknown_fields=True, kw_only=True):
    integer_fields: ClassVar[tuple[str, ...]] = (*SamplingFields.integer_fields, "max_completion_tokens", "top_logprobs")
    prompt_param: ClassVar[str] = "messages"

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.logprobs = bool(self.logprobs)

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequestError("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict]:
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in self.messages]


class CompletionRequest(SamplingFields, forbid_unknown_fields=True, kw_only=True):
    integer_fields: ClassVar[tuple[str, ...]] = (*SamplingFields.integer_fields, "logprobs")

    prompt: str | list[Any] | None = None  # null or absent: an empty document (the BOS token alone)
    max_tokens: int | None = 16  # OpenAI's default for completions (chat: the rest of the context)
    logprobs: int | None = None
    echo: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.prompt = "" if self.prompt is None else self.prompt
        self.max_tokens = 16 if self.max_tokens is None else self.max_tokens
        self.echo = bool(self.echo)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list: one string, strings, one token list, or token lists (whole floats are ints)."""
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        prompt = self.prompt
        if isinstance(prompt, list):
            prompt = [[_whole(t) for t in p] if isinstance(p, list) else _whole(p) for p in prompt]
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            return [list(p) for p in prompt]
        raise InvalidRequestError(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", param="prompt"
        )


def decode_body(raw: bytes | dict, kind: type[SamplingFields]) -> SamplingFields:
    """Parse a JSON body (bytes, or an already decoded object) strictly into `kind`.

    A body msgspec's typed decoder refuses gets one more try with whole floats in
    `kind.integer_fields` and in the token-id lists of `kind.token_id_fields`
    (`"stop_token_ids": [2.0]`) made ints; the prompt's token ids are `prompts()`'s. Raises msgspec errors, which the middleware maps to
    a 400 naming the field.
    """
    if isinstance(raw, bytes):
        try:
            return msgspec.json.decode(raw, type=kind, strict=True)  # the common case: one pass
        except msgspec.ValidationError:
            raw = msgspec.json.decode(raw)
    body = raw
    if isinstance(body, dict):
        for name in kind.integer_fields:
            if name in body:
                body[name] = _whole(body[name])
        for name in kind.token_id_fields:
            value = body.get(name)
            if isinstance(value, list):
                body[name] = [_whole(v) for v in value]
    return msgspec.convert(body, kind, strict=True)


def _whole(value: Any) -> Any:
    """A float with no fraction as the int it is (JSON has one number type); anything else as is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value
