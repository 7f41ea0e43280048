"""Run the service: uvloop, the app, graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal
import sys

import structlog
from aiohttp import web

from config import Settings
from service.app import create_app, drain, load_engine

log = structlog.get_logger(__name__)


async def serve(settings: Settings, ready_message: bool = True, engine_factory=load_engine) -> None:
    """Serve until SIGTERM or SIGINT, then drain (running streams finish, up to the timeout) and exit."""
    server = settings.server
    app = create_app(settings, engine_factory)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, server.host, server.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else server.port
    url = f"http://{server.host}:{port}"
    log.info("listening", url=url)
    if ready_message:
        from service.state import STATE

        model = app[STATE].model_name
        print(
            f"\npagedserve is serving {model!r} at {url}\n"
            f"try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"        -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Tell me a story\"}}], "
            f"\"max_tokens\": 64}}'\n",
            file=sys.stderr, flush=True,
        )
    await stop.wait()
    log.info("shutting down: draining", timeout_s=server.shutdown_timeout_s)
    await drain(app, server.shutdown_timeout_s)
    await runner.cleanup()
    log.info("stopped")


def run(settings: Settings, engine_factory=load_engine) -> None:
    import uvloop

    uvloop.run(serve(settings, engine_factory=engine_factory))
