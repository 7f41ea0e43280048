"""OpenAI request bodies as strict msgspec Structs, and their mapping onto SamplingParams.

Unknown fields are rejected by name; types are strict (no "5" for 5). vLLM's extra
sampling fields (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from runtime.sampling_params import InvalidRequestError, SamplingParams

MAX_STOP_STRINGS = 4


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


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
    """Fields shared by chat and completion requests."""

    model: str
    max_tokens: int | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # prefix caching: a client salt splits the tenant's cache further; a prompt_cache_key
    # that an operator marked as shared selects that shared prefix
    cache_salt: str | None = None
    prompt_cache_key: str | None = None

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
        if max_tokens is None:
            max_tokens = max_model_len - num_prompt_tokens
            if max_tokens < 1:
                raise InvalidRequestError(
                    f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                    f"{num_prompt_tokens}", param="messages", code="context_length_exceeded",
                )
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
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

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
    prompt: str | list[Any]
    max_tokens: int | None = 16  # OpenAI's default for completions (chat: the rest of the context)
    logprobs: int | None = None
    echo: bool = False

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list: one string, strings, one token list, or token lists."""
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        prompt = self.prompt
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


def decode_body(raw: bytes, kind: type[msgspec.Struct]):
    """Parse a JSON body strictly into `kind` (raises msgspec errors the middleware maps to 400)."""
    return msgspec.json.decode(raw, type=kind, strict=True)
