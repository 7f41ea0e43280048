"""Anthropic's Messages API request bodies (POST /v1/messages, /v1/messages/count_tokens) as strict msgspec
Structs, and their mapping onto a chat completion body: one generation core behind both APIs.

    system + messages (text, tool_use, tool_result blocks)  ->  chat messages (system, user, assistant
                                                                 with tool_calls, tool)
    tools (input_schema)                                     ->  function tools (parameters)
    tool_choice auto / any / tool / none                     ->  "auto" / "required" / named / "none"
    max_tokens, stop_sequences, temperature, top_p, top_k    ->  the same sampling fields
    metadata.user_id                                         ->  user

Unknown fields are a 400 naming them; fields this text model cannot honour (images, documents,
extended thinking, server tools, MCP servers, containers) are a 400 naming them too.
`cache_control` breakpoints (and the top-level `cache_control`) are accepted: every full page of
a prompt is cached within the tenant's salt whether marked or not. `output_config.format` (a
JSON schema) constrains the output through the grammar path. Recent clients no longer send
`temperature`, `top_p` and `top_k`; older ones do, and they are honoured. `cache_salt` (vLLM's extension) splits the tenant's cache
further, as on the OpenAI routes.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from runtime.sampling_params import InvalidRequestError


class CacheControl(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["ephemeral"]
    ttl: str | None = None  # "5m" | "1h": pages stay while the pool keeps them (LRU), whatever is asked


class ContentBlock(msgspec.Struct, forbid_unknown_fields=True):
    """A request content block: text, tool_use (assistant) or tool_result (user); others are refused."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    citations: Any = None
    source: Any = None  # image / document: refused
    title: str | None = None
    context: str | None = None
    signature: str | None = None  # thinking blocks: refused
    thinking: str | None = None
    data: str | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    input_schema: dict | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent; a server tool's type (web_search_...) is refused
    cache_control: CacheControl | None = None


class ToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class OutputFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["json_schema"]
    schema: dict


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: OutputFormat | None = None  # structured outputs: the grammar path, as response_format json_schema
    effort: str | None = None  # one effort here: accepted, ignored


class Thinking(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


REFUSED_FIELDS = {
    "thinking": "extended thinking is not available for this model",
    "container": "code-execution containers are not available here",
    "mcp_servers": "MCP servers are not available here",
}


class CountTokensRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/messages/count_tokens: what the prompt of a Messages request would be."""

    model: str
    messages: list[Message]
    system: str | list[ContentBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    mcp_servers: Any = None

    def check_fields(self) -> None:
        for name, why in REFUSED_FIELDS.items():
            value = getattr(self, name, None)
            if value is not None and not (name == "thinking" and value.type == "disabled"):
                raise InvalidRequestError(f"{name} is not supported: {why}", param=name)
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if self.messages[0].role != "user":
            raise InvalidRequestError("the first message must use the user role", param="messages[0].role")

    def chat_fields(self) -> dict:
        """The chat completion body's fields for the prompt: messages, tools, tool_choice."""
        fields: dict[str, Any] = {"messages": self._chat_messages()}
        if self.tools:
            fields["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            choice = self.tool_choice
            if choice.type == "tool":
                if not choice.name:
                    raise InvalidRequestError('tool_choice type "tool" needs a name', param="tool_choice.name")
                fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return fields

    def _chat_messages(self) -> list[dict]:
        out: list[dict] = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else _text_of(self.system, "system")
            if text:
                out.append({"role": "system", "content": text})
        for i, message in enumerate(self.messages):
            where = f"messages[{i}]"
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
                continue
            texts: list[str] = []
            calls: list[dict] = []
            for j, block in enumerate(message.content):
                at = f"{where}.content[{j}]"
                if block.type == "text":
                    texts.append(block.text or "")
                elif block.type == "tool_use" and message.role == "assistant":
                    if not block.id or not block.name:
                        raise InvalidRequestError("a tool_use block needs id and name", param=at)
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name, "arguments": msgspec.json.encode(
                                      block.input if block.input is not None else {}).decode()}})
                elif block.type == "tool_result" and message.role == "user":
                    if not block.tool_use_id:
                        raise InvalidRequestError("a tool_result block needs tool_use_id", param=f"{at}.tool_use_id")
                    content = block.content
                    result = content if isinstance(content, str) or content is None else _text_of(content, at)
                    if block.is_error:
                        result = f"Error: {result or ''}"
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result or ""})
                else:
                    raise InvalidRequestError(f"content blocks of type {block.type!r} cannot be read here"
                                              + (" (this model takes text)" if block.type in ("image", "document")
                                                 else ""), param=f"{at}.type")
            if texts or calls or message.role == "assistant":
                chat: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
                if calls:
                    chat["tool_calls"] = calls
                out.append(chat)
        return out


class MessagesRequest(CountTokensRequest, forbid_unknown_fields=True, kw_only=True):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # top level: the last block is marked; every full page is cached anyway
    # accepted, ignored: one tier, one speed, one region here; no diagnostics, profiles or workspaces
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: dict | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    container: Any = None
    # vLLM's extensions, as on the OpenAI routes
    cache_salt: str | None = None
    priority: int | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if self.temperature is not None and not 0.0 <= self.temperature <= 1.0:
            raise InvalidRequestError("temperature must be between 0 and 1", param="temperature")
        if self.messages[-1].role == "assistant":
            raise InvalidRequestError("prefill (a last message from the assistant) is not supported: end with a "
                                      "user message", param=f"messages[{len(self.messages) - 1}].role")

    def chat_body(self) -> dict:
        """The equivalent chat completion request, as a JSON object for protocol.decode_body."""
        body = {"model": self.model, "max_tokens": self.max_tokens, **self.chat_fields(),
                "stream": bool(self.stream)}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "top_k", "cache_salt", "priority"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.stop_sequences:
            body["stop"] = list(self.stop_sequences)
        if self.metadata is not None and self.metadata.user_id:
            body["user"] = self.metadata.user_id
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": self.output_config.format.schema}}
        return body


def _text_of(blocks: list[ContentBlock], where: str) -> str:
    """The text of text blocks (a system prompt, a tool result); any other block is a 400."""
    pieces = []
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise InvalidRequestError(f"only text blocks can be read here, not {block.type!r}",
                                      param=f"{where}[{j}].type" if where == "system" else f"{where}.content[{j}].type")
        pieces.append(block.text or "")
    return "".join(pieces)


def _chat_tool(tool: ToolDefinition, index: int) -> dict:
    if tool.type not in (None, "custom"):
        raise InvalidRequestError(f"server tools ({tool.type!r}) are not available here: give custom tools",
                                  param=f"tools[{index}].type")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}
