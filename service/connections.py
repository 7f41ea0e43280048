"""Connection hygiene: how long a connection may go without a request head, and how many one address holds.

    server.idle_timeout_s          aiohttp's keep-alive timer, armed when a connection opens and again after
                                   each response; when it fires on a connection still waiting for a whole
                                   request head, the connection is closed. Bytes arriving do not re-arm it, so
                                   it is the header timeout too: a head sent a byte a second (slowloris) is
                                   closed idle_timeout_s after the connection opened. A request being handled
                                   (a long stream, a WebSocket) is never cut by it.
    server.max_connections_per_ip  connections open from one address; one past the cap is closed before a
                                   byte of it is read (0: no cap).
    server.max_requests_per_connection  requests one keep-alive connection may carry; the last one's answer
                                   closes it (`keep_alive_cap`, a middleware; 0: no cap).

`start_site` serves a bound socket with both: each connection's protocol is aiohttp's own request
handler behind a thin `_CountedConnection` that counts it by peer address.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter

import structlog
from aiohttp import web

log = structlog.get_logger(__name__)

REFUSAL_LOG_EVERY_S = 10.0  # refused connections are logged as a count, at most this often


def make_runner(app: web.Application, idle_timeout_s: float) -> web.AppRunner:
    """The app's runner: handlers cancelled when their client goes, no access log, the idle/header timeout."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=idle_timeout_s)


class ConnectionCounts:
    """Open connections per peer address, and the refusals past the cap."""

    def __init__(self, max_per_ip: int) -> None:
        if max_per_ip < 0:
            raise ValueError(f"max_per_ip must be >= 0 (0: no cap), got {max_per_ip}")
        self.max_per_ip = max_per_ip
        self.open: Counter[str] = Counter()
        self._refused_since_log = 0
        self._logged_at = 0.0

    def admit(self, address: str) -> bool:
        """Count a new connection from `address`; False (nothing counted) if the address is at its cap."""
        if self.max_per_ip and self.open[address] >= self.max_per_ip:
            self._refused_since_log += 1
            now = time.monotonic()
            if now - self._logged_at >= REFUSAL_LOG_EVERY_S:
                log.warning("connections refused: address at its cap", address=address,
                            max_connections_per_ip=self.max_per_ip, num_refused=self._refused_since_log)
                self._logged_at, self._refused_since_log = now, 0
            return False
        self.open[address] += 1
        return True

    def release(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]


class _CountedConnection(asyncio.Protocol):
    """aiohttp's handler for one connection, counted by address; a refused one never reaches the handler."""

    def __init__(self, handler: asyncio.Protocol, counts: ConnectionCounts) -> None:
        self.handler = handler
        self.counts = counts
        self.address: str | None = None  # None: refused (or not yet made)
        self.num_requests = 0  # requests begun on this connection (keep_alive_cap)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) and peer else str(peer)
        if not self.counts.admit(address):
            transport.abort()
            return
        self.address = address
        self.handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.address is None:
            return
        self.counts.release(self.address)
        self.address = None
        self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.address is not None:
            self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.address is not None else None

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


class CountedSockSite(web.BaseSite):
    """aiohttp's SockSite, with each connection counted against max_connections_per_ip."""

    __slots__ = ("_sock", "_counts", "_name")

    def __init__(self, runner: web.AppRunner, sock: socket.socket, counts: ConnectionCounts) -> None:
        super().__init__(runner)
        self._sock = sock
        self._counts = counts
        host, port = sock.getsockname()[:2]
        self._name = f"http://{host}:{port}"

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        if server is None:
            raise RuntimeError("the runner was cleaned up before its site started")
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _CountedConnection(server(), self._counts), sock=self._sock, backlog=self._backlog)


def keep_alive_cap(max_requests: int):
    """A middleware closing a connection after its `max_requests`-th request is answered (0: never)."""
    @web.middleware
    async def cap_requests(request: web.Request, handler):
        transport = request.transport
        connection = transport.get_protocol() if transport is not None else None
        if not max_requests or not isinstance(connection, _CountedConnection):
            return await handler(request)
        connection.num_requests += 1
        response = await handler(request)
        if connection.num_requests >= max_requests:
            response.force_close()
        return response

    return cap_requests


async def start_site(runner: web.AppRunner, sock: socket.socket, max_connections_per_ip: int) -> None:
    """Serve the bound `sock` through `runner` (set up), each connection counted against the cap."""
    await CountedSockSite(runner, sock, ConnectionCounts(max_connections_per_ip)).start()
