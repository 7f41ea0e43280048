"""OpenAI's Responses API request body (POST /v1/responses) as a strict msgspec Struct, its field
table, and its mapping onto chat messages: one generation core behind every API.

    instructions                      ->  a system message first (never carried to the next turn)
    input: a string                   ->  one user message
    input items: message              ->  a chat message (input_text / output_text / refusal parts as text)
                 function_call        ->  a tool call on the assistant message before it (or a new one)
                 function_call_output ->  a tool message (tool_call_id = call_id)
    previous_response_id              ->  the stored turn's context (its messages and its answer) first
    max_output_tokens, temperature, top_p, tools (function), tool_choice, parallel_tool_calls,
    text.format (text / json_object / json_schema), user, safety_identifier, prompt_cache_key
                                      ->  the chat fields of the same meaning

Every official field has one answer in RESPONSES_FIELDS (supported, ignored and said, or a 400
naming it); a field outside it is a 400 "unknown field".
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from runtime.sampling_params import InvalidRequestError
from service.api.openai_fields import IGNORED, REFUSED, SUPPORTED

RESPONSES_FIELDS: dict[str, tuple[str, str]] = {
    "model": (SUPPORTED, "must name the served model"),
    "input": (SUPPORTED, "a string, or items: message (input_text, output_text and refusal parts), function_call, "
                         "function_call_output; image, file and audio parts, item_reference and reasoning items are a "
                         "400 naming them"),
    "instructions": (SUPPORTED, "a system message before the input; not carried into the next turn, as OpenAI"),
    "max_output_tokens": (SUPPORTED, ""),
    "temperature": (SUPPORTED, ""),
    "top_p": (SUPPORTED, ""),
    "tools": (SUPPORTED, "function tools; built-in tools (web search, file search, computer, ...) are a 400"),
    "tool_choice": (SUPPORTED, "none, auto, required and {\"type\": \"function\", \"name\"} (grammar-constrained)"),
    "parallel_tool_calls": (SUPPORTED, "false: at most one call"),
    "text": (SUPPORTED, "format: text, json_object, json_schema (grammar-constrained); verbosity is ignored"),
    "stream": (SUPPORTED, "typed events with sequence_number"),
    "stream_options": (SUPPORTED, "include_obfuscation is accepted and ignored"),
    "store": (SUPPORTED, "default true: kept per tenant (SQLite, or Redis when configured) for "
                         "server.responses_retention_s"),
    "previous_response_id": (SUPPORTED, "the tenant's own stored responses only; its prompt reads the earlier turn's "
                                        "pages from the prefix cache"),
    "background": (SUPPORTED, "needs store; runs after the reply, cancel with POST /v1/responses/{id}/cancel; "
                              "not with stream"),
    "metadata": (SUPPORTED, "up to 16 string pairs, stored and returned"),
    "user": (SUPPORTED, "logged with the request"),
    "safety_identifier": (SUPPORTED, "logged with the request"),
    "prompt_cache_key": (SUPPORTED, "selects an operator's shared prefix; see Prefix caching"),
    "truncation": (SUPPORTED, "disabled (a prompt over the context is a 400); auto is a 400 (not built)"),
    "include": (SUPPORTED, "nothing to add: every includable names output this server does not make (search "
                           "results, images, encrypted reasoning), except message.output_text.logprobs, a 400"),
    "reasoning": (IGNORED, "the served model has no reasoning mode"),
    "service_tier": (IGNORED, "one tier here"),
    "prompt_cache_retention": (IGNORED, "the prefix cache keeps pages until evicted; pin a prefix to keep it"),
    "prompt_cache_options": (IGNORED, "every full page of a prompt is cached within the tenant's salt"),
    "max_tool_calls": (IGNORED, "it limits built-in tool calls, and there are none here"),
    "background_options": (IGNORED, "background responses run as they are"),
    "top_logprobs": (REFUSED, "output logprobs are not built for this API yet (chat completions has them)"),
    "conversation": (REFUSED, "the Conversations API is not served: continue with previous_response_id"),
    "prompt": (REFUSED, "stored prompt templates are not served"),
    "context_management": (REFUSED, "compaction is not built"),
    "moderation": (REFUSED, "no moderation runs here"),
    "image": (REFUSED, "the model has no image output"),
    "access_programs": (REFUSED, "programmatic tool calling is not available here"),
}

# where a chat field's error is reported on this API
CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
               "tools": "tools", "tool_choice": "tool_choice"}
MAX_METADATA_PAIRS = 16


class InputPart(msgspec.Struct, forbid_unknown_fields=True):
    """A message content part: text ones are read; images, files and audio are refused by name."""

    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: Any = None  # output_text sent back: read as its text
    logprobs: Any = None
    prompt_cache_breakpoint: Any = None  # every full page is cached anyway
    image_url: Any = None
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None
    detail: Any = None
    input_audio: Any = None


class InputItem(msgspec.Struct, forbid_unknown_fields=True):
    """One input item: a message, a function_call (an earlier answer's) or a function_call_output."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    id: str | None = None
    status: str | None = None
    phase: str | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None
    arguments: str | None = None
    namespace: str | None = None
    caller: Any = None
    output: str | list[InputPart] | None = None  # function_call_output
    summary: Any = None  # reasoning items: refused
    encrypted_content: Any = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: dict | None = None
    verbosity: str | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/responses (and a WebSocket `response.create`)."""

    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    # accepted, ignored (RESPONSES_FIELDS says why)
    reasoning: Any = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    max_tool_calls: int | None = None
    background_options: Any = None
    # a 400 naming them
    top_logprobs: int | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    # vLLM's extensions, as on the chat route
    cache_salt: str | None = None
    priority: int | None = None
    top_k: int | None = None

    def check_fields(self) -> None:
        """Raise InvalidRequestError naming the first field this server refuses or that is malformed."""
        for name, (answer, why) in RESPONSES_FIELDS.items():
            if answer == REFUSED and getattr(self, name, None) is not None:
                raise InvalidRequestError(f"{name} is not supported: {why}", param=name)
        if self.input is None or self.input == [] or self.input == "":
            raise InvalidRequestError("input must be a non-empty string or list of items", param="input")
        if self.truncation not in (None, "disabled"):
            raise InvalidRequestError("truncation \"auto\" is not built: prompts over the context are a 400",
                                      param="truncation")
        if self.include and "message.output_text.logprobs" in self.include:
            raise InvalidRequestError("output logprobs are not built for this API yet", param="include")
        if self.background and self.store is False:
            raise InvalidRequestError("background responses must be stored: store cannot be false", param="background")
        if self.background and self.stream:
            raise InvalidRequestError("background responses cannot be streamed here: poll GET /v1/responses/{id}",
                                      param="background")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_PAIRS:
            raise InvalidRequestError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs", param="metadata")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError("temperature must be between 0 and 2", param="temperature")
        if self.top_p is not None and not 0.0 <= self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be between 0 and 1", param="top_p")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequestError("max_output_tokens must be at least 1", param="max_output_tokens")

    @property
    def stored(self) -> bool:
        return self.store is not False

    def ignored(self) -> list[str]:
        """The IGNORED fields this body set, in table order."""
        ignored = [name for name, (answer, _) in RESPONSES_FIELDS.items()
                   if answer == IGNORED and getattr(self, name, None) is not None]
        if self.text is not None and self.text.verbosity is not None:
            ignored.append("text.verbosity")
        if self.stream_options is not None and self.stream_options.include_obfuscation is not None:
            ignored.append("stream_options.include_obfuscation")
        return ignored

    def input_items(self) -> list[dict]:
        """The input as items (a string is one user message), each with an id, as input_items lists them."""
        if isinstance(self.input, str):
            return [{"id": _item_id("msg"), "type": "message", "role": "user", "status": "completed",
                     "content": [{"type": "input_text", "text": self.input}]}]
        items = []
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if item.type == "message":
                role = item.role
                if role not in ("user", "assistant", "system", "developer"):
                    raise InvalidRequestError("a message's role must be user, assistant, system or developer",
                                              param=f"{where}.role")
                kind = "output_text" if role == "assistant" else "input_text"
                text = _text(item.content, f"{where}.content", role)
                items.append({"id": item.id or _item_id("msg"), "type": "message", "role": role,
                              "status": "completed", "content": [{"type": kind, "text": text}]})
            elif item.type == "function_call":
                if not item.call_id or not item.name or item.arguments is None:
                    raise InvalidRequestError("a function_call item needs call_id, name and arguments", param=where)
                items.append({"id": item.id or _item_id("fc"), "type": "function_call", "status": "completed",
                              "call_id": item.call_id, "name": item.name, "arguments": item.arguments})
            elif item.type == "function_call_output":
                if not item.call_id:
                    raise InvalidRequestError("a function_call_output item needs call_id", param=f"{where}.call_id")
                output = item.output if isinstance(item.output, str) else _text(item.output, f"{where}.output", "tool")
                items.append({"id": item.id or _item_id("fco"), "type": "function_call_output", "status": "completed",
                              "call_id": item.call_id, "output": output})
            else:
                raise InvalidRequestError(f"input items of type {item.type!r} cannot be read here (message, "
                                          "function_call and function_call_output can)", param=f"{where}.type")
        return items

    def chat_fields(self) -> dict:
        """The chat completion body's fields other than messages: sampling, tools, format, identity."""
        body: dict[str, Any] = {"model": self.model}
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user"),
                             ("safety_identifier", "safety_identifier"), ("prompt_cache_key", "prompt_cache_key"),
                             ("cache_salt", "cache_salt"), ("priority", "priority"), ("top_k", "top_k")):
            value = getattr(self, ours)
            if value is not None:
                body[theirs] = value
        if self.tools:
            body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _chat_format(self.text.format)
        return body


def items_as_messages(items: list[dict]) -> list[dict]:
    """Input or output items as chat messages: function calls join the assistant message before them."""
    messages: list[dict] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(part.get("text") or part.get("refusal") or "" for part in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: str | list[InputPart] | None, where: str, role: str) -> str:
    if content is None:
        raise InvalidRequestError("content is required", param=where)
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text", "text") and part.text is not None:
            pieces.append(part.text)
        elif part.type == "refusal" and role == "assistant" and part.refusal is not None:
            pieces.append(part.refusal)
        else:
            raise InvalidRequestError(f"content parts of type {part.type!r} cannot be read: this model takes text",
                                      param=f"{where}[{j}].type")
    return "".join(pieces)


FUNCTION_TOOL_KEYS = {"type", "name", "description", "parameters", "strict", "defer_loading", "allowed_callers",
                      "output_schema"}


def _chat_tool(tool: dict, index: int) -> dict:
    where = f"tools[{index}]"
    if tool.get("type") != "function":
        raise InvalidRequestError(f"tools of type {tool.get('type')!r} are not available here: give function tools",
                                  param=f"{where}.type")
    unknown = sorted(set(tool) - FUNCTION_TOOL_KEYS)
    if unknown:
        raise InvalidRequestError(f"unknown field `{unknown[0]}` in a function tool", param=f"{where}.{unknown[0]}")
    if not isinstance(tool.get("name"), str):
        raise InvalidRequestError("a function tool needs a name", param=f"{where}.name")
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError("tool_choice must be none, auto, required or a function", param="tool_choice")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) != {"type", "name"}:
        raise InvalidRequestError('tool_choice must be none, auto, required or {"type": "function", "name": ...} '
                                  "(built-in and allowed_tools choices are not available here)", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _chat_format(fmt: dict) -> dict:
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        if set(fmt) != {"type"}:
            raise InvalidRequestError(f"text.format {kind} takes no other field", param="text.format")
        return {"type": kind}
    if kind == "json_schema":
        unknown = sorted(set(fmt) - {"type", "name", "schema", "description", "strict"})
        if unknown:
            raise InvalidRequestError(f"unknown field `{unknown[0]}` in text.format", param=f"text.format.{unknown[0]}")
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequestError("text.format json_schema needs a name and a schema", param="text.format")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise InvalidRequestError("text.format.type must be text, json_object or json_schema", param="text.format.type")
