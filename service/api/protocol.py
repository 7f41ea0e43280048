"""OpenAI request bodies as strict msgspec Structs, and their mapping onto SamplingParams.

Unknown fields are rejected by name; types are strict (no "5" for 5), with two allowances
OpenAI's own spec makes: `null` in an optional field means its default, and a whole number
sent as a float (`"seed": 7.0`) is that integer (`7.5` is still a 400). Every official field
has an answer (service/api/openai_fields.py: supported, accepted and ignored, or a 400 naming
it). vLLM's extra fields are accepted: sampling (top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids, include_stop_str_in_output, min_tokens), scheduling (priority) and structured outputs
(structured_outputs, guided_json, guided_regex, guided_choice, guided_grammar).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, ClassVar, Literal

import msgspec

from runtime.json_limits import check_json_depth, decode_json
from runtime.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputs
from service.api.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, REFUSED

MAX_STOP_STRINGS = 4
MAX_MESSAGES = 4096  # messages in one chat request
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for schema and function names


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted, ignored (openai_fields)
    continuous_usage_stats: bool | None = None  # vLLM's: every chunk carries the usage so far


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    """A message content part; only text (and an assistant's refusal) can reach a text model."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: Any = None  # 400 (openai_fields.MESSAGE_FIELDS)
    function_call: Any = None  # 400

    def text(self, where: str) -> str:
        if not isinstance(self.content, list):
            return self.content or ""
        pieces = []
        for j, part in enumerate(self.content):
            if part.type == "text" and part.text is not None:
                pieces.append(part.text)
            elif part.type == "refusal" and self.role == "assistant" and part.refusal is not None:
                pieces.append(part.refusal)
            else:
                raise InvalidRequestError(f"content parts of type {part.type!r} cannot be read: this model takes text",
                                          param=f"{where}.content[{j}].type")
        return "".join(pieces)

    def as_dict(self, where: str) -> dict:
        """The message as a chat template reads it (tool call arguments as objects where they parse)."""
        for field in ("audio", "function_call"):
            if getattr(self, field) is not None:
                raise InvalidRequestError(f"{field} in a message is not supported", param=f"{where}.{field}")
        if self.role == "function":
            raise InvalidRequestError("role \"function\" is deprecated: send role \"tool\" with tool_call_id",
                                      param=f"{where}.role")
        message: dict[str, Any] = {"role": self.role, "content": self.text(where)}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidRequestError("only assistant messages carry tool_calls", param=f"{where}.tool_calls")
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                               "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls
            ]
        if self.role == "tool":
            if not self.tool_call_id:
                raise InvalidRequestError("a tool message needs tool_call_id", param=f"{where}.tool_call_id")
            message["tool_call_id"] = self.tool_call_id
        if self.refusal is not None:
            message["refusal"] = self.refusal
        return message


def _arguments(text: str) -> Any:
    """A call's arguments as the object they encode (what chat templates expect), else the text."""
    try:
        return decode_json(text)
    except (msgspec.DecodeError, InvalidRequestError):  # not JSON, or nested past the limit: the text as it is
        return text


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputs | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputs(json_object=True, param="response_format")
        spec = self.json_schema
        if spec is None:
            raise InvalidRequestError("response_format json_schema needs a json_schema object",
                                      param="response_format.json_schema")
        if not NAME_PATTERN.match(spec.name):
            raise InvalidRequestError("json_schema.name must be 1-64 letters, digits, _ or -",
                                      param="response_format.json_schema.name")
        if spec.schema is None:
            return StructuredOutputs(json_object=True, param="response_format.json_schema.schema")
        return StructuredOutputs(json=spec.schema, param="response_format.json_schema.schema")


class VllmStructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` body field."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by chat and completion requests. Every optional field may be null: its default."""

    integer_fields: ClassVar[tuple[str, ...]] = ("n", "max_tokens", "seed", "top_k", "priority")
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
    min_tokens: int | None = None
    # scheduling: lower first among the tenant's own waiting requests (engine.scheduling = "fair"; fcfs: arrival order)
    priority: int | None = None
    # prefix caching: a client salt splits the tenant's cache further; a prompt_cache_key
    # that an operator marked as shared selects that shared prefix
    cache_salt: str | None = None
    prompt_cache_key: str | None = None
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's response_format; vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: VllmStructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # vLLM's backend choice: one engine here; ignored, and said so

    fields_table: ClassVar[dict] = {}

    def __post_init__(self) -> None:
        self.n = 1 if self.n is None else self.n
        self.stream = bool(self.stream)
        self.ignore_eos = bool(self.ignore_eos)
        self.include_stop_str_in_output = bool(self.include_stop_str_in_output)
        self.priority = 0 if self.priority is None else self.priority

    def prediction_text(self) -> str | None:
        """A Predicted Outputs text, where the API has the field (chat)."""
        return None

    def check_fields(self) -> None:
        """Raise InvalidRequestError for a field this server refuses (openai_fields: REFUSED) or a bad
        combination. Called by decode_body (an error raised while msgspec decodes would lose its param)."""
        for name, (answer, why) in self.fields_table.items():
            if answer == REFUSED and getattr(self, name, None) is not None:
                raise InvalidRequestError(f"{name} is not supported: {why}", param=name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's stream_options.continuous_usage_stats)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None

    @property
    def samples_per_prompt(self) -> int:
        """Samples the engine draws per prompt: n, or completions' best_of (of which n are returned)."""
        return self.n

    @property
    def picks_best(self) -> bool:
        """More samples than choices (completions' best_of > n): the n with the highest logprob per token are returned."""
        return self.samples_per_prompt > self.n

    def output_constraint(self) -> StructuredOutputs | None:
        """The output's constraint from response_format, structured_outputs or guided_* (at most one)."""
        given: list[StructuredOutputs] = []
        if self.response_format is not None:
            spec = self.response_format.structured_outputs()
            if spec is not None:
                given.append(spec)
        if self.structured_outputs is not None:
            fields = msgspec.structs.asdict(self.structured_outputs)
            fields["json_object"] = bool(fields["json_object"])
            given.append(StructuredOutputs(**fields, param="structured_outputs"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given.append(StructuredOutputs(**{kind: value}, param=name))
        if len(given) > 1:
            raise InvalidRequestError("give one output constraint: " + ", ".join(g.param for g in given),
                                      param=given[1].param)
        return given[0] if given else None

    def token_logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            bias[int(key)] = value
        return bias

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int,
                        constraint: StructuredOutputs | None = None) -> SamplingParams:
        """SamplingParams for this body; max_tokens defaults to the rest of the context.

        `constraint` is the output's grammar (output_constraint(), or the tool plan's).
        """
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
            "logprobs": self.requested_logprobs(), "logit_bias": self.token_logit_bias(),
            "structured_outputs": constraint, "min_tokens": self.min_tokens,
        }
        try:
            return SamplingParams(
                n=self.samples_per_prompt, max_tokens=max_tokens, stop=stop,
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                **{k: v for k, v in given.items() if v is not None},
            )
        except InvalidRequestError as exc:  # named as the caller named it
            field = self.field_of(exc.param)
            if field != exc.param and exc.param and exc.message.startswith(exc.param + " "):
                exc.message = field + exc.message[len(exc.param):]
                exc.args = (exc.message,)
            exc.param = field
            raise

    def field_of(self, sampling_param: str | None) -> str | None:
        """The body's field that gave SamplingParams' `sampling_param` (most keep their names)."""
        return sampling_param


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; absent: no arguments
    strict: bool | None = None  # arguments always match the schema when constrained; accepted either way


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: FunctionDefinition | None = None
    custom: Any = None


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: FunctionName | None = None


class ChatCompletionRequest(SamplingFields, forbid_unknown_fields=True, kw_only=True):
    integer_fields: ClassVar[tuple[str, ...]] = (*SamplingFields.integer_fields, "max_completion_tokens", "top_logprobs")
    prompt_param: ClassVar[str] = "messages"
    fields_table: ClassVar[dict] = CHAT_FIELDS

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    safety_identifier: str | None = None
    prediction: dict | None = None  # Predicted Outputs: {"type": "content", "content": text or text parts}
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template (enable_thinking)
    # accepted and ignored (openai_fields.CHAT_FIELDS says why)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # a 400 naming them
    audio: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.logprobs = bool(self.logprobs)

    def check_fields(self) -> None:
        super().check_fields()
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise InvalidRequestError("this model writes text only: modalities must be [\"text\"]", param="modalities")
        self.prediction_text()

    def prediction_text(self) -> str | None:
        """The `prediction`'s text; InvalidRequestError (param "prediction") if it is not a content prediction."""
        prediction = self.prediction
        if prediction is None:
            return None
        if not isinstance(prediction, dict) or prediction.get("type") != "content" or set(prediction) - {"type", "content"}:
            raise InvalidRequestError('prediction must be {"type": "content", "content": ...}', param="prediction")
        content = prediction.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) and set(p) == {"type", "text"}
                                             for p in content):
            return "".join(p["text"] for p in content)
        raise InvalidRequestError("prediction.content must be a string or a list of text parts", param="prediction")

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequestError("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def field_of(self, sampling_param: str | None) -> str | None:
        return "top_logprobs" if sampling_param == "logprobs" and self.top_logprobs is not None else sampling_param

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict]:
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if len(self.messages) > MAX_MESSAGES:
            raise InvalidRequestError(f"{len(self.messages)} messages; a request takes at most {MAX_MESSAGES}",
                                      param="messages", code="too_many_messages")
        return [m.as_dict(f"messages[{i}]") for i, m in enumerate(self.messages)]


class CompletionRequest(SamplingFields, forbid_unknown_fields=True, kw_only=True):
    integer_fields: ClassVar[tuple[str, ...]] = (*SamplingFields.integer_fields, "logprobs", "best_of")
    fields_table: ClassVar[dict] = COMPLETION_FIELDS

    prompt: str | list[Any] | None = None  # null or absent: an empty document (the BOS token alone)
    max_tokens: int | None = 16  # OpenAI's default for completions (chat: the rest of the context)
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None  # a 400 (openai_fields.COMPLETION_FIELDS)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.prompt = "" if self.prompt is None else self.prompt
        self.max_tokens = 16 if self.max_tokens is None else self.max_tokens
        self.echo = bool(self.echo)

    def check_fields(self) -> None:
        super().check_fields()
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo with logprobs needs prompt logprobs, which this server does not compute",
                                      param="echo")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError(f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise InvalidRequestError("best_of greater than n cannot be streamed", param="best_of")

    @property
    def samples_per_prompt(self) -> int:
        return self.n if self.best_of is None else self.best_of

    def field_of(self, sampling_param: str | None) -> str | None:
        return "best_of" if sampling_param == "n" and self.best_of is not None else sampling_param


    def requested_logprobs(self) -> int | None:
        if self.logprobs is None and self.picks_best:
            return 0  # the chosen tokens' logprobs rank the samples (not shown unless asked)
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list: one string, strings, one token list, or token lists (whole floats are ints)."""
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
    """Parse a JSON body (bytes, or an already decoded object) strictly into `kind`, then check_fields().

    A body msgspec's typed decoder refuses gets one more try with whole floats in
    `kind.integer_fields` and in the token-id lists of `kind.token_id_fields`
    (`"stop_token_ids": [2.0]`) made ints; the prompt's token ids are `prompts()`'s. Raises msgspec errors
    and InvalidRequestError, which the middleware maps to a 400 naming the field.
    """
    if isinstance(raw, bytes):
        check_json_depth(raw)
        try:
            body = msgspec.json.decode(raw, type=kind, strict=True)  # the common case: one pass
        except msgspec.ValidationError:
            try:
                raw = msgspec.json.decode(raw)
            except msgspec.ValidationError as exc:  # a number past float64 ("1e999"): msgspec cannot say where
                path = _first_non_finite(json.loads(raw))
                raise InvalidRequestError(f"{path or 'a number'} is out of range (past a 64-bit float)",
                                          param=path, code="invalid_value") from exc
        else:
            body.check_fields()
            return body
    body = raw
    if isinstance(body, dict):
        for name in kind.integer_fields:
            if name in body:
                body[name] = _whole(body[name])
        for name in kind.token_id_fields:
            value = body.get(name)
            if isinstance(value, list):
                body[name] = [_whole(v) for v in value]
    body = msgspec.convert(body, kind, strict=True)
    body.check_fields()
    return body


def _first_non_finite(value: Any, path: str = "") -> str | None:
    """Where the first infinite number sits in a decoded body ("temperature", "messages[0].x"), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _first_non_finite(item, f"{path}.{key}" if isinstance(key, str) and path else
                                  key if isinstance(key, str) else f"{path}[{key}]")
        if found:
            return found
    return None


def _whole(value: Any) -> Any:
    """A float with no fraction as the int it is (JSON has one number type); anything else as is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value
