"""OpenAI's Responses API on the chat generation core.

    POST   /v1/responses                     create (JSON, typed SSE events, or background)
    GET    /v1/responses/{id}                a stored response
    DELETE /v1/responses/{id}                delete it
    POST   /v1/responses/{id}/cancel         stop a running one (background or streaming)
    GET    /v1/responses/{id}/input_items    its input items (a list page)

A Responses body becomes chat messages (responses_protocol.py) and runs as a chat generation: the
same tenant, limits, ledger, prefix cache, tools and grammar path. Its output events (the chat core's,
typed: service/api/core/events.py) become output items
(`OutputItems`): a `message` item (one `output_text` part) while text comes, a `function_call`
item per parsed tool call. Streaming and JSON share that one path; streaming writes its events:

    response.created, response.in_progress,
    per item: output_item.added, [content_part.added, output_text.delta..., output_text.done,
              content_part.done | function_call_arguments.delta..., .done], output_item.done,
    response.completed | response.incomplete (max_output_tokens, or cancelled) | response.failed
    (after an `error` event)

each with a `sequence_number` counting from 0. A stored response (store, the default) keeps the
conversation as chat messages, so `previous_response_id` rebuilds the same prompt tokens and the
earlier turn's pages are prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import msgspec
import structlog
from aiohttp import web

from runtime.json_limits import decode_json
from runtime.sampling_params import InvalidRequestError
from service.api.completions import SSE_HEADERS, chat_generation
from service.api.core.events import Finished, OutputEvent, TextDelta, ToolArgsDelta, ToolCallStarted
from service.api.core.translator import OutputTranslator
from service.api.generation import Generation
from service.api.openai_fields import IGNORED_HEADER
from service.api.protocol import ChatCompletionRequest, decode_body
from service.api.responses_protocol import CHAT_PARAMS, ResponsesRequest, items_as_messages
from service.errors import APIError, from_exception
from service.request_lease import RequestLease
from service.responses_store import StoredResponse
from service.state import STATE, ServiceState
from service.tenants import Tenant

log = structlog.get_logger(__name__)

CANCEL_WAIT_S = 10.0  # how long a cancel waits for the run to end and say so


def _not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"No response with id '{response_id}' found.", param, "response_not_found")


class OutputItems:
    """Output events (service/api/core/events.py) -> Responses output items and the events that build them (no
    sequence numbers)."""

    def __init__(self) -> None:
        self.output: list[dict] = []
        self._open: dict | None = None  # the item being written
        self._text: list[str] = []

    def _add(self, item: dict) -> list[dict]:
        events = self.close()
        self.output.append(item)
        self._open = item
        return events + [{"type": "response.output_item.added", "output_index": len(self.output) - 1,
                          "item": _copy(item)}]

    def text(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._add({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                                 "status": "in_progress", "content": []})
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                           "part": _text_part("")})
            self._text = []
        self._text.append(text)
        return events + [{"type": "response.output_text.delta", **self._where(), "content_index": 0, "delta": text,
                          "logprobs": []}]

    def encode(self, event: OutputEvent) -> list[dict]:
        """The Responses events for one output event (none for Finished: the run's status says it)."""
        if isinstance(event, TextDelta):
            return self.text(event.text)
        if isinstance(event, ToolCallStarted):
            return self._add({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                              "call_id": event.call_id, "name": event.name, "arguments": ""})
        if isinstance(event, ToolArgsDelta) and self._open is not None and self._open["type"] == "function_call":
            self._open["arguments"] += event.arguments
            return [{"type": "response.function_call_arguments.delta", **self._where(), "delta": event.arguments}]
        return []

    def close(self, status: str = "completed") -> list[dict]:
        """End the open item (status: completed, or incomplete when the output was cut)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        if item["type"] == "message":
            text = "".join(self._text)
            item["content"] = [_text_part(text)]
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": _text_part(text)}]
        else:
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": _copy(item)}]

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(part) for part in item["content"]]} if "content" in item else dict(item)


class Run:
    """One response from its start to its end: the body, its generation, its output, its stored form."""

    def __init__(self, state: ServiceState, tenant: Tenant, body: ResponsesRequest, generation: Generation,
                 response_id: str, input_items: list[dict], context: list[dict]) -> None:
        self.state = state
        self.tenant = tenant
        self.body = body
        self.generation = generation
        self.response_id = response_id
        self.input_items = input_items
        self.context = context  # the chat messages before this turn's input (a previous response's)
        self.created_at = int(time.time())
        self.items = OutputItems()
        self.translator = OutputTranslator(generation.fmt.tool_plan)
        self.status = "queued" if body.background else "in_progress"
        self.incomplete_details: dict | None = None
        self.error: dict | None = None
        self.cancelled = False
        self.ended = asyncio.get_running_loop().create_future()  # the final response object, once stored

    def events(self, deltas: list) -> list[dict]:
        """The events for one wake-up's deltas (choice 0: this API asks for one)."""
        events: list[dict] = []
        for index, delta in deltas:
            for event in self.translator.events(index, delta):
                if isinstance(event, Finished):
                    self._finished(event.engine_reason)
                else:
                    events += self.items.encode(event)
        return events

    def _finished(self, engine_reason: str | None) -> None:
        if self.cancelled or engine_reason == "abort":
            self.status = "cancelled"
        elif engine_reason == "length":
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"

    def close(self) -> list[dict]:
        """The last items' done events (the stream ended: by the model, the limit, or a cancel)."""
        if self.status == "in_progress":  # the streams ended without a finish reason: stopped from outside
            self.status = "cancelled"
        return self.items.close("completed" if self.status == "completed" else "incomplete")

    def fail(self, error: APIError) -> None:
        self.status = "failed"
        self.error = {"code": error.code or "server_error", "message": error.message}

    def usage(self) -> dict:
        usage = self.generation.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        written = self.generation.num_cache_written_tokens
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}

    def response(self, with_usage: bool = True) -> dict:
        """The response object as it stands."""
        body = self.body
        text_format = body.text.format if body.text is not None and body.text.format is not None else {"type": "text"}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": bool(body.background), "error": self.error, "incomplete_details": self.incomplete_details,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "model": self.state.model_name, "output": self.items.output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None}, "safety_identifier": body.safety_identifier,
            "service_tier": "default", "store": body.stored,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text_format, "verbosity": "medium"},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": [_echo_tool(tool) for tool in body.tools or []],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
            "usage": self.usage() if with_usage else None, "user": body.user, "metadata": body.metadata or {},
        }

    async def end(self) -> dict:
        """Keep the response (when asked to; the conversation so far goes with it), settle `ended`, return it.

        A store that fails is logged, not raised: the answer was served and billed, only its stored copy
        is missing.
        """
        response = self.response()
        if self.body.stored:
            context = self.context + items_as_messages(self.input_items) + items_as_messages(self.items.output)
            try:
                await self.state.responses.put(self.tenant.tenant_id, self.response_id,
                                               StoredResponse(response, self.input_items, context))
            except Exception:
                log.exception("response not stored", response_id=self.response_id)
        if not self.ended.done():
            self.ended.set_result(response)
        return response

    async def abandon(self) -> dict:
        """The client left (or its task was stopped): stop the engine work, end as cancelled."""
        self.cancel()
        self.close()
        return await self.end()

    def release(self) -> None:
        """Off the running list, engine work stopped and billed (Generation.finish); `ended` settled as it stands."""
        self.state.running_responses.pop(self.key, None)
        self.generation.finish()
        if not self.ended.done():
            self.ended.set_result(self.response())

    @property
    def key(self) -> tuple[str, str]:
        """Its place in state.running_responses: (tenant, response id)."""
        return self.tenant.tenant_id, self.response_id

    def cancel(self) -> None:
        """Stop the engine work; the run ends with status cancelled."""
        self.cancelled = True
        for stream in self.generation.streams:
            if not stream.finished:
                self.state.bridge.abort(stream.request_id)


def _echo_tool(tool: dict) -> dict:
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


def _our_param(param: str | None) -> str | None:
    """A chat field's error param as this API names it."""
    if param is None:
        return None
    head = re.match(r"[a-z_]+", param).group(0)
    if head == "tools":
        return param.replace(".function", "")
    if head == "response_format":
        return "text.format" + param[len("response_format"):].replace(".json_schema", "")
    return CHAT_PARAMS.get(head, param)


async def _prepare(state: ServiceState, tenant: Tenant, body: ResponsesRequest) -> Run:
    input_items = body.input_items()
    context: list[dict] = []
    if body.previous_response_id is not None:
        previous = await state.responses.get(tenant.tenant_id, body.previous_response_id)
        if previous is None:  # another tenant's id reads the same as one that never existed
            raise _not_found(body.previous_response_id, "previous_response_id")
        if previous.response["status"] in ("queued", "in_progress"):
            raise APIError(400, f"response '{body.previous_response_id}' is still in progress", "previous_response_id")
        context = previous.context
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    response_id = f"resp_{uuid.uuid4().hex}"
    try:
        chat = await state.preprocess(tenant, _chat_body, body, system + context, input_items)
        generation = await chat_generation(state, chat, tenant, response_id, api="responses")
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message, param=_our_param(exc.param), code=exc.code) from exc
    return Run(state, tenant, body, generation, response_id, input_items, context)


def _chat_body(body: ResponsesRequest, messages: list[dict], input_items: list[dict]) -> ChatCompletionRequest:
    """The chat body a create runs as: `messages` (instructions, the previous responses' context), then its input."""
    return decode_body({**body.chat_fields(), "messages": messages + items_as_messages(input_items)},
                       ChatCompletionRequest)


def _decode(state: ServiceState, raw: bytes | dict) -> ResponsesRequest:
    """A create body (JSON bytes, or a decoded object) parsed and checked, its model too."""
    if isinstance(raw, bytes):
        body = decode_json(raw, type=ResponsesRequest)
    else:
        body = msgspec.convert(raw, ResponsesRequest, strict=True)
    body.check_fields()
    state.check_model(body.model)
    return body


async def start_run(state: ServiceState, tenant: Tenant, raw: bytes | dict, lease: RequestLease) -> Run:
    """A create body validated, its prompt built and admitted on the request's `lease`; not started."""
    body = await state.preprocess(tenant, _decode, state, raw)
    run = await _prepare(state, tenant, body)
    await run.generation.admit(lease)
    return run


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    state = request.app[STATE]
    tenant = state.authenticate(request)
    raw = await state.read_body(request)
    async with RequestLease(state, tenant, len(raw)) as lease:
        run = await start_run(state, tenant, raw, lease)
    body = run.body
    ignored = body.ignored()
    headers = {IGNORED_HEADER: ", ".join(ignored)} if ignored else {}
    state.running_responses[run.key] = run
    if body.background:
        try:
            run.generation.start()
            response = run.response(with_usage=False)
            await state.responses.put(tenant.tenant_id, run.response_id, StoredResponse(response, run.input_items, []))
        except BaseException:
            run.release()
            raise
        state.spawn(_background(run))
        return web.json_response(response, headers=headers)
    try:
        run.generation.start()
        if body.stream:
            return await _stream(request, run, headers)
        return await _whole(run, headers)
    finally:
        run.release()


async def _consume(run: Run) -> None:
    async for deltas in run.generation.deltas():
        run.events(deltas)
    run.close()


async def _whole(run: Run, headers: dict) -> web.Response:
    try:
        await _consume(run)
    except asyncio.CancelledError:  # the client left: keep what was made, as cancelled (release() bills it)
        await run.abandon()
        raise
    await run.generation.usage_recorded()  # the answer goes out only once its bill is on disk
    return web.json_response(await run.end(), headers=headers)


async def _background(run: Run) -> None:
    run.status = "in_progress"
    try:
        await _consume(run)
        await run.generation.usage_recorded()
    except Exception as exc:
        run.fail(from_exception(exc))
    finally:  # stopped and billed before it is stored, so a waiting cancel sees the final usage
        run.state.running_responses.pop(run.key, None)
        run.generation.finish()
    await run.end()


def _sse(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


async def _stream(request: web.Request, run: Run, headers: dict) -> web.StreamResponse:
    response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
    await response.prepare(request)
    try:
        await drive(run, lambda events: response.write(b"".join(_sse(event) for event in events)))
    except ConnectionError:
        return response  # the client left: drive() cancelled and stored the run; release() bills it
    await response.write_eof()
    return response


async def drive(run: Run, emit) -> None:
    """Run a started response to its end, handing its events, numbered, to `await emit(events)`.

    The last events go out once the usage is on disk and the response is stored. If `emit` raises
    ConnectionError (the client left) or the task is cancelled, the run is cancelled, stored as it
    stands (status cancelled), and that re-raised.
    """
    sequence = 0

    def numbered(events: list[dict]) -> list[dict]:
        nonlocal sequence
        for event in events:
            event["sequence_number"] = sequence
            sequence += 1
        return events

    failure: APIError | None = None
    try:
        start = run.response(with_usage=False)
        await emit(numbered([{"type": "response.created", "response": start},
                             {"type": "response.in_progress", "response": start}]))
        async for deltas in run.generation.deltas():
            events = run.events(deltas)
            if events:
                await emit(numbered(events))
        closing = run.close()
        await run.generation.usage_recorded()  # the stream's end goes out only once its bill is on disk
    except (ConnectionError, asyncio.CancelledError):  # the client left, or its task was stopped
        await run.abandon()
        raise
    except Exception as exc:
        failure = from_exception(exc)
        run.fail(failure)
        closing = run.items.close("incomplete")
    stored = await run.end()
    if failure is not None:
        last = [{"type": "error", "code": failure.code, "message": failure.message, "param": failure.param},
                {"type": "response.failed", "response": stored}]
    else:
        kind = "response.completed" if run.status == "completed" else "response.incomplete"
        last = [{"type": kind, "response": stored}]
    await emit(numbered(closing + last))


def _target(request: web.Request) -> tuple[ServiceState, Tenant, str]:
    """(state, the caller's tenant, the path's response id)."""
    state = request.app[STATE]
    return state, state.authenticate(request), request.match_info["response_id"]


async def _stop_if_running(state: ServiceState, tenant: Tenant, response_id: str) -> dict | None:
    """Cancel the tenant's running response and wait (up to CANCEL_WAIT_S) for its last form; None if none runs."""
    run = state.running_responses.get((tenant.tenant_id, response_id))
    if run is None:
        return None
    run.cancel()
    done, _ = await asyncio.wait([run.ended], timeout=CANCEL_WAIT_S)
    return run.ended.result() if done else run.response()


async def get_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: the tenant's stored response (404 for any other id, another tenant's too)."""
    state, tenant, response_id = _target(request)
    if request.query.get("stream") not in (None, "false"):
        raise APIError(400, "resuming a stream is not supported: GET the response without stream", "stream")
    stored = await state.responses.get(tenant.tenant_id, response_id)
    if stored is None:
        raise _not_found(response_id)
    return web.json_response(stored.response)


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}: a running one is cancelled first."""
    state, tenant, response_id = _target(request)
    await _stop_if_running(state, tenant, response_id)
    if not await state.responses.delete(tenant.tenant_id, response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    """POST /v1/responses/{id}/cancel: stop a running response; a cancelled one is returned as it is."""
    state, tenant, response_id = _target(request)
    stopped = await _stop_if_running(state, tenant, response_id)
    if stopped is not None:
        return web.json_response(stopped)
    stored = await state.responses.get(tenant.tenant_id, response_id)
    if stored is None:
        raise _not_found(response_id)
    status = stored.response["status"]
    if status != "cancelled":
        raise APIError(400, f"response '{response_id}' is {status}, not running: only a running response can be "
                       "cancelled", "response_id", "response_not_running")
    return web.json_response(stored.response)


async def list_input_items(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}/input_items?limit=&order=&after=: the response's own input items, a page."""
    state, tenant, response_id = _target(request)
    query = request.query
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be an integer from 1 to 100", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be asc or desc", "order")
    stored = await state.responses.get(tenant.tenant_id, response_id)
    if stored is None:
        raise _not_found(response_id)
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"no input item '{after}' in this response", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
