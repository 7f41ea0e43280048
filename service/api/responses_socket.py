"""GET /v1/responses upgraded to a WebSocket: the Responses API's WebSocket mode, many responses at once.

client -> {"type": "response.create", "stream_id"?: lane, ...the POST /v1/responses body, no stream/background}
client -> {"type": "response.cancel", "response_id": "resp_..."}       (ours: cancel by id on this socket)
server -> the streaming events of each response, as over SSE, each with its own sequence numbers,
          and the lane's "stream_id" when the create named one
server -> {"type": "error", "status", "error": {"type", "code", "message", "param"}, "stream_id"?}

Lanes follow OpenAI's WebSocket spec: creates with the same stream_id run one after another (FIFO);
different lanes, and creates without a stream_id, run at once, each response its own id (vLLM's
socket refuses a second response with 409). A cancel stops a running response of this tenant,
from this socket or any other (POST /v1/responses/{id}/cancel does the same). Closing the socket
stops its running responses; each is billed and, when stored, kept as cancelled.
"""

from __future__ import annotations

import asyncio

import msgspec
import structlog
from aiohttp import WSMsgType, web

from runtime.json_limits import decode_json
from runtime.sampling_params import InvalidRequestError
from service.api.responses import drive, start_run
from service.errors import WEBSOCKET, APIError, from_exception
from service.request_lease import RequestLease
from service.state import STATE, ServiceState
from service.tenants import Tenant

log = structlog.get_logger(__name__)


class ResponsesSocket:
    """One connection: its lanes (the last task of each), its tasks, and a serialized writer."""

    def __init__(self, ws: web.WebSocketResponse, state: ServiceState, tenant: Tenant) -> None:
        self.ws = ws
        self.state = state
        self.tenant = tenant
        self.lanes: dict[str, asyncio.Task] = {}  # stream_id -> its newest create's task
        self.tasks: set[asyncio.Task] = set()
        self.write_lock = asyncio.Lock()

    async def send(self, events: list[dict], stream_id: str | None) -> None:
        """Send events, each as one text frame; a closed socket raises ConnectionError (the run then stops)."""
        async with self.write_lock:
            for event in events:
                if self.ws.closed:
                    raise ConnectionResetError("the WebSocket closed")
                if stream_id is not None:
                    event["stream_id"] = stream_id
                await self.ws.send_str(msgspec.json.encode(event).decode())

    async def error(self, exc: Exception, stream_id: str | None = None) -> None:
        error = from_exception(exc)
        body = error.body()["error"]
        try:
            await self.send([{"type": "error", "status": error.status, "error": body}], stream_id)
        except ConnectionError:
            pass

    async def handle(self, raw: str) -> None:
        try:
            message = decode_json(raw)
            if not isinstance(message, dict):
                raise InvalidRequestError("send a JSON object", param="type")
        except (msgspec.DecodeError, InvalidRequestError) as exc:
            await self.error(exc)
            return
        kind = message.pop("type", None)
        if kind == "response.cancel":
            await self._cancel(message)
            return
        if kind != "response.create":
            await self.error(InvalidRequestError("type must be response.create or response.cancel", param="type"))
            return
        stream_id = message.pop("stream_id", None)
        if stream_id is not None and not isinstance(stream_id, str):
            await self.error(InvalidRequestError("stream_id must be a string", param="stream_id"))
            return
        previous = self.lanes.get(stream_id) if stream_id is not None else None
        task = asyncio.create_task(self._run(message, len(raw), stream_id, previous))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if stream_id is not None:
            self.lanes[stream_id] = task
            task.add_done_callback(lambda done: self.lanes.pop(stream_id, None) if self.lanes.get(stream_id) is done
                                   else None)

    async def _cancel(self, message: dict) -> None:
        response_id = message.get("response_id")
        run = self.state.running_responses.get((self.tenant.tenant_id, response_id))
        if run is None:
            await self.error(APIError(404, f"No running response with id '{response_id}'.", "response_id",
                                      "response_not_found"))
            return
        run.cancel()  # its own stream then ends with response.incomplete, status cancelled

    async def _run(self, body: dict, num_bytes: int, stream_id: str | None, previous: asyncio.Task | None) -> None:
        if previous is not None:  # the lane's earlier response first (FIFO); its failure is its own
            await asyncio.wait([previous])
        try:
            for field in ("stream", "background"):
                if body.get(field) is not None:
                    raise InvalidRequestError(f"{field} is not a WebSocket field (events always stream; no background)",
                                              param=field)
            async with RequestLease(self.state, self.tenant, num_bytes) as lease:
                run = await start_run(self.state, self.tenant, body, lease)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self.error(exc, stream_id)
            return
        self.state.running_responses[run.key] = run
        try:
            run.generation.start()
            await drive(run, lambda events: self.send(events, stream_id))
        except ConnectionError:
            pass  # the socket closed: drive() cancelled and stored the run
        finally:
            run.release()

    async def close(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def responses_websocket(request: web.Request) -> web.WebSocketResponse:
    """GET /v1/responses: the WebSocket mode (a plain GET is a 400 saying so)."""
    state = request.app[STATE]
    tenant = state.authenticate(request)  # 401 before the upgrade
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=state.settings.server.max_body_bytes)
    if not ws.can_prepare(request).ok:
        raise APIError(400, "GET /v1/responses is the Responses WebSocket mode: open a WebSocket (POST creates "
                       "a response over HTTP)", None, "websocket_required")
    await ws.prepare(request)
    request[WEBSOCKET] = ws
    socket = ResponsesSocket(ws, state, tenant)
    try:
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                try:
                    await socket.handle(message.data)
                except Exception as exc:  # our bug: this frame's error, and the socket goes on
                    log.error("websocket frame failed", error_type=type(exc).__name__, exc_info=exc)
                    await socket.error(exc)
            elif message.type == WSMsgType.BINARY:
                await socket.error(APIError(400, "send JSON text frames", None))
    finally:
        await socket.close()
    return ws
