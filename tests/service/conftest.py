"""A real server on a random loopback port, run on its own thread and uvloop."""

import asyncio
import tempfile
import threading
from contextlib import contextmanager

import pytest
import uvloop
from aiohttp import web

from config import load_settings
from service.app import create_app, load_engine
from service.state import STATE


class RunningServer:
    def __init__(self, url: str, app: web.Application, loop: asyncio.AbstractEventLoop) -> None:
        self.url = url
        self.app = app
        self.loop = loop

    @property
    def state(self):
        return self.app[STATE]

    def call(self, coro_fn, timeout: float = 10.0):
        """Run `coro_fn()` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until the engine reports nothing running or waiting and every page free."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.state.bridge.stats
            if (stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
                    and self.state.bridge.num_inflight == 0):
                return stats
            time.sleep(0.02)
        raise AssertionError(f"engine not idle: {self.state.bridge.stats}, inflight={self.state.bridge.num_inflight}")


@contextmanager
def run_server(settings, engine_factory=load_engine):
    app = create_app(settings, engine_factory)
    loop = uvloop.new_event_loop()
    started = threading.Event()
    holder = {}

    async def start():
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["runner"] = runner
        holder["port"] = site._server.sockets[0].getsockname()[1]

    def thread_main():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=thread_main, daemon=True)
    thread.start()
    if not started.wait(60):
        raise RuntimeError("server did not start")
    server = RunningServer(f"http://127.0.0.1:{holder['port']}", app, loop)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def stories_settings(stories_dir, server: dict | None = None, **engine):
    """Settings for stories260K with a fresh data folder (ledger, journal) per server."""
    data_dir = tempfile.mkdtemp(prefix="pagedserve-test-")
    return load_settings(environ={}, overrides={
        "server": {"model": str(stories_dir), "data_dir": data_dir, **(server or {})},
        "engine": {"num_blocks": 256, "max_num_seqs": 32, **engine},
    })


@pytest.fixture(scope="module")
def server(stories_dir):
    with run_server(stories_settings(stories_dir)) as running:
        yield running
