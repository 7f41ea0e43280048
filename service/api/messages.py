"""Anthropic's Messages API on the chat generation core: POST /v1/messages (JSON or SSE events) and
POST /v1/messages/count_tokens.

A Messages body becomes a chat completion body (messages_protocol.py) and runs as one: the same
tenant, limits, ledger, prefix cache, tools and grammar path. What comes back (the chat core's
typed output events: service/api/core/events.py) is encoded as Messages:

    chat message content / tool_calls  ->  content blocks: text / tool_use (input: the arguments object)
    finish_reason stop / length / tool_calls  ->  stop_reason end_turn (stop_sequence when a stop
                                                   sequence ended it) / max_tokens / tool_use
    usage prompt / cached / completion   ->  input_tokens (neither read from nor written to the cache),
                                              cache_read_input_tokens, cache_creation_input_tokens (the
                                              prompt's full pages this request put into the prefix cache:
                                              every full page is cached, marked or not), output_tokens

Streaming sends Anthropic's named events: message_start (once the first token is there, so its
usage knows the cached part), ping, content_block_start / content_block_delta (text_delta,
input_json_delta) / content_block_stop per block, message_delta (stop_reason, usage),
message_stop; a failure mid-stream is an `error` event. Errors are Anthropic's shape
({"type": "error", "error": {"type", "message"}}: service/errors.py).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from aiohttp import web

from runtime.errors import InvalidRequestError
from runtime.json_limits import decode_json
from service.api.completions import SSE_HEADERS, chat_generation, chat_prompt
from service.api.core.events import Finished, OutputEvent, TextDelta, ToolArgsDelta, ToolCallStarted
from service.api.core.translator import OutputTranslator, WholeOutput
from service.api.generation import ChoiceAccumulator, Generation
from service.api.messages_protocol import CountTokensRequest, MessagesRequest
from service.api.protocol import ChatCompletionRequest, decode_body
from service.errors import APIError, from_exception
from service.request_lease import RequestLease
from service.state import STATE, ServiceState
from service.tenants import Tenant

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def authenticate(state: ServiceState, request: web.Request) -> Tenant:
    """The tenant of `x-api-key` (Anthropic's header) or, failing that, `Authorization: Bearer`."""
    key = request.headers.get("x-api-key")
    authorization = f"Bearer {key}" if key else request.headers.get("Authorization")
    if not authorization and not state.tenants.is_open:  # asked for as Anthropic's clients send it
        raise APIError(401, "x-api-key header is required", None, "invalid_api_key")
    return state.tenants.authenticate(authorization)


def _decode(raw: bytes, kind: type[CountTokensRequest]) -> CountTokensRequest:
    body = decode_json(raw, type=kind)
    body.check_fields()
    return body


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    state = request.app[STATE]
    tenant = authenticate(state, request)
    raw = await state.read_body(request)
    async with RequestLease(state, tenant, len(raw)) as lease:
        body, chat = await state.preprocess(tenant, _chat_of_messages, raw)
        generation = await chat_generation(state, chat, tenant, api="messages")
        await generation.admit(lease)
    try:
        generation.start()
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        if body.stream:
            return await _stream(request, generation, message_id, body.stop_sequences or [])
        return await _whole(generation, message_id, body.stop_sequences or [])
    finally:
        generation.finish()


def _chat_of_messages(raw: bytes) -> tuple[MessagesRequest, ChatCompletionRequest]:
    """A Messages body and the chat body it runs as (on a preprocessing thread)."""
    body = _decode(raw, MessagesRequest)
    return body, decode_body(body.chat_body(), ChatCompletionRequest)


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: {"input_tokens": the prompt's length, tools included}."""
    state = request.app[STATE]
    tenant = authenticate(state, request)
    raw = await state.read_body(request)
    async with RequestLease(state, tenant, len(raw)) as lease:
        prompt = await state.preprocess(tenant, _count_prompt, state, raw)
        lease.used_tokens = len(prompt)
    return web.json_response({"input_tokens": len(prompt)})


def _count_prompt(state: ServiceState, raw: bytes) -> list[int]:
    body = _decode(raw, CountTokensRequest)
    prompt, _, _ = chat_prompt(state, decode_body({"model": body.model, **body.chat_fields()}, ChatCompletionRequest))
    return prompt


def _usage(generation: Generation) -> dict:
    usage = generation.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    written = generation.num_cache_written_tokens
    return {"input_tokens": usage["prompt_tokens"] - cached - written, "cache_creation_input_tokens": written,
            "cache_read_input_tokens": cached, "output_tokens": usage["completion_tokens"]}


def _stop(finish_reason: str | None, matched: int | str | None, stops: list[str],
          called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for the chat finish_reason; `matched`: the engine's stop reason (the stop
    string or id that ended it); `called`: the answer holds a tool_use block (a named tool choice finishes
    with "stop" in chat, as OpenAI's does, and with tool_use here, as Anthropic's)."""
    if called:
        return "tool_use", None
    if finish_reason in STOP_REASONS:
        return STOP_REASONS[finish_reason], None
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return ("end_turn" if finish_reason is not None else None), None


def _blocks(whole: WholeOutput) -> list[dict]:
    """A choice's text and tool calls as Messages content blocks."""
    blocks = [{"type": "text", "text": whole.text}] if whole.text else []
    for call_id, name, arguments in whole.calls:
        blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": _tool_input(arguments)})
    return blocks


def _tool_input(arguments: str) -> Any:
    """A tool call's arguments (the model's text) as its input object; text that is not JSON, or nests past
    the limit, as the text itself."""
    try:
        return decode_json(arguments or "{}")
    except (msgspec.DecodeError, InvalidRequestError):
        return arguments


def _message(generation: Generation, message_id: str, content: list[dict], stop_reason: str | None,
             stop_sequence: str | None) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": generation.fmt.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(generation)}


async def _whole(generation: Generation, message_id: str, stops: list[str]) -> web.Response:
    acc = ChoiceAccumulator()
    async for deltas in generation.deltas():
        for index, delta in deltas:
            acc.add(index, delta)
    whole = WholeOutput(OutputTranslator(generation.fmt.tool_plan).events(0, acc.choices[0]))
    await generation.usage_recorded()  # the answer goes out only once its bill is on disk
    blocks = _blocks(whole)
    finished = whole.finished
    stop_reason, stop_sequence = _stop(finished and finished.reason, finished and finished.stop_reason, stops,
                                       bool(whole.calls))
    return web.json_response(_message(generation, message_id, blocks, stop_reason, stop_sequence))


def _event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


class _Blocks:
    """Turns output events into content block events: one open block at a time, numbered from 0."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text" | "tool_use" | None
        self.called = False  # a tool_use block was started

    def _start(self, kind: str, block: dict) -> list[bytes]:
        events = self.close()
        self.index += 1
        self.open = kind
        return events + [_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                        "content_block": block})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def text(self, text: str) -> list[bytes]:
        events = self._start("text", {"type": "text", "text": ""}) if self.open != "text" else []
        return events + [_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                        "delta": {"type": "text_delta", "text": text}})]

    def encode(self, event: OutputEvent) -> list[bytes]:
        """The content block events for one output event (none for Finished: message_delta says it)."""
        if isinstance(event, TextDelta):
            return self.text(event.text)
        if isinstance(event, ToolCallStarted):
            self.called = True
            return self._start("tool_use", {"type": "tool_use", "id": event.call_id, "name": event.name, "input": {}})
        if isinstance(event, ToolArgsDelta):
            delta = {"type": "input_json_delta", "partial_json": event.arguments}
            return [_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})]
        return []


async def _stream(request: web.Request, generation: Generation, message_id: str, stops: list[str]) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    translator = OutputTranslator(generation.fmt.tool_plan)
    blocks = _Blocks()
    started = False
    finish_reason = matched = None
    try:
        async for deltas in generation.deltas():
            out: list[bytes] = []
            if not started:
                start = _message(generation, message_id, [], None, None)
                start["usage"]["output_tokens"] = 0
                out += [_event("message_start", {"type": "message_start", "message": start}),
                        _event("ping", {"type": "ping"})]
            started = True
            for index, delta in deltas:
                for event in translator.events(index, delta):
                    if isinstance(event, Finished):
                        finish_reason, matched = event.reason, event.stop_reason
                    else:
                        out += blocks.encode(event)
            if out:
                await response.write(b"".join(out))
    except (ConnectionResetError, ConnectionError):
        return response  # the client left; finish() aborts the engine request
    except Exception as exc:
        await response.write(_event("error", from_exception(exc).anthropic_body()))
        await response.write_eof()
        return response
    try:
        await generation.usage_recorded()  # the stream's end goes out only once its bill is on disk
    except APIError as exc:  # no message_stop: the client sees the answer did not complete
        await response.write(_event("error", exc.anthropic_body()))
        await response.write_eof()
        return response
    stop_reason, stop_sequence = _stop(finish_reason, matched, stops, blocks.called)
    usage = _usage(generation)
    await response.write(b"".join([
        *blocks.close(),
        _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                                    "stop_sequence": stop_sequence},
                                 "usage": {"output_tokens": usage["output_tokens"],
                                           "input_tokens": usage["input_tokens"],
                                           "cache_read_input_tokens": usage["cache_read_input_tokens"],
                                           "cache_creation_input_tokens": usage["cache_creation_input_tokens"]}}),
        _event("message_stop", {"type": "message_stop"}),
    ]))
    await response.write_eof()
    return response
