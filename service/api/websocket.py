"""GET /v1/stream: many chat completions over one WebSocket, each with its own id.

client -> {"type": "request", "id": "r1", "body": {...chat completion body...}}
client -> {"type": "cancel", "id": "r1"}
server -> {"type": "chunk", "id": "r1", "completion_id": "chatcmpl-...", ...other chunk fields...}
server -> {"type": "done", "id": "r1", "usage": {...}, "finish_reasons": [...], ["ignored_fields": [...]]}
server -> {"type": "error", "id": "r1" | null, "error": {...}}

A cancel ends that request (its usage so far comes in its "done"); closing the socket
ends all of its requests.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import msgspec
import structlog
from aiohttp import WSMsgType, web

from runtime.errors import InvalidRequestError
from runtime.json_limits import decode_json
from service.errors import WEBSOCKET, APIError, from_exception
from service.api.formatting import usage_dict
from service.api.completions import chat_generation
from service.api.generation import Generation
from service.api.protocol import ChatCompletionRequest, decode_body
from service.request_lease import RequestLease
from service.state import STATE

log = structlog.get_logger(__name__)


class Command(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["request", "cancel"]
    id: str
    body: dict[str, Any] | None = None


class Socket:
    """One client connection: its running requests and a serialized writer."""

    def __init__(self, ws: web.WebSocketResponse, state, tenant) -> None:
        self.ws = ws
        self.state = state
        self.tenant = tenant
        self.tasks: dict[str, asyncio.Task] = {}
        self.cancelled: set[str] = set()  # ids the client cancelled (vs. the socket closing)
        self.started: set[str] = set()  # ids whose task has begun running
        self.pending_sends: set[asyncio.Future] = set()
        self.write_lock = asyncio.Lock()

    async def send(self, message: dict) -> None:
        if self.ws.closed:
            return
        async with self.write_lock:
            await self.ws.send_str(msgspec.json.encode(message).decode())

    async def error(self, request_id: str | None, exc: Exception) -> None:
        await self.send({"type": "error", "id": request_id, "error": from_exception(exc).body()["error"]})

    async def handle(self, raw: str) -> None:
        try:
            command = decode_json(raw, type=Command)
        except (msgspec.ValidationError, msgspec.DecodeError, InvalidRequestError) as exc:
            await self.error(None, exc)
            return
        if command.type == "cancel":
            task = self.tasks.get(command.id)
            if task is None:
                await self.error(command.id, APIError(404, f"no running request with id {command.id!r}", "id"))
                return
            self.cancelled.add(command.id)
            task.cancel()
            return
        if command.id in self.tasks:
            await self.error(command.id, APIError(400, f"request id {command.id!r} is already running", "id"))
            return
        task = asyncio.create_task(self.run(command.id, command.body or {}, len(raw)))
        self.tasks[command.id] = task
        task.add_done_callback(lambda done, request_id=command.id: self._forget(request_id, done))

    def _forget(self, request_id: str, task: asyncio.Task) -> None:
        """Drop a finished task; a request cancelled before it ever ran still gets its "done"."""
        if self.tasks.get(request_id) is task:
            del self.tasks[request_id]
        never_ran = request_id not in self.started
        self.started.discard(request_id)
        if request_id in self.cancelled:
            self.cancelled.discard(request_id)
            if never_ran and task.cancelled():
                message = {"type": "done", "id": request_id, "usage": usage_dict(0, 0, 0), "finish_reasons": ["abort"]}
                self.pending_sends.add(asyncio.ensure_future(self.send(message)))

    async def run(self, request_id: str, raw_body: dict, num_bytes: int) -> None:
        self.started.add(request_id)
        generation = None
        try:
            async with RequestLease(self.state, self.tenant, num_bytes) as lease:
                body = await self.state.preprocess(self.tenant, decode_body, raw_body, ChatCompletionRequest)
                generation = await chat_generation(self.state, body, self.tenant)
                await generation.admit(lease)
            generation.start()
            fmt = generation.fmt
            started: set[int] = set()
            async for deltas in generation.deltas():
                choices = []
                for index, delta in deltas:
                    choices.append(fmt.delta_choice(index, delta, first=index not in started))
                    started.add(index)
                chunk = fmt.chunk(choices)
                chunk["completion_id"] = chunk.pop("id")  # "id" is the client's request id
                await self.send({"type": "chunk", "id": request_id, **chunk})
            await self._done(request_id, generation)
        except asyncio.CancelledError:
            if generation is not None and generation.admitted:
                generation.finish()  # stops the engine work and bills what was computed
            if request_id not in self.cancelled:
                raise  # the socket is closing
            await self._done(request_id, generation)  # cancelled while it was read, too: "done" still comes
        except Exception as exc:
            await self.error(request_id, exc)
        finally:
            if generation is not None and generation.admitted:
                generation.finish()

    async def _done(self, request_id: str, generation: Generation | None) -> None:
        """The request's end: its usage (nothing if it was never admitted) and finish reasons."""
        if generation is None or not generation.admitted:
            await self.send({"type": "done", "id": request_id, "usage": usage_dict(0, 0, 0), "finish_reasons": ["abort"]})
            return
        try:
            await generation.usage_recorded()  # "done" goes out only once the bill is on disk
        except APIError as exc:
            await self.error(request_id, exc)
            return
        reasons = [r for s in generation.streams for r in s.finish_reasons]
        done = {"type": "done", "id": request_id, "usage": generation.usage(), "finish_reasons": reasons}
        if generation.ignored_fields:
            done["ignored_fields"] = generation.ignored_fields
        await self.send(done)

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self.pending_sends, return_exceptions=True)


async def websocket_stream(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    tenant = state.authenticate(request)  # 401 before the upgrade
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=state.settings.server.max_body_bytes)
    await ws.prepare(request)
    request[WEBSOCKET] = ws
    socket = Socket(ws, state, tenant)
    try:
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                try:
                    await socket.handle(message.data)
                except Exception as exc:  # our bug: this frame's error, and the socket goes on
                    log.error("websocket frame failed", error_type=type(exc).__name__, exc_info=exc)
                    await socket.error(None, exc)
            elif message.type == WSMsgType.BINARY:
                await socket.error(None, APIError(400, "send JSON text frames", None))
    finally:
        await socket.close()
    return ws
