"""Run the service: uvloop, the app, graceful shutdown on SIGTERM/SIGINT.

Start-up is all or nothing (service/startup.py): the port is bound first, then the engine
is built (or, with the Dynamo router, the workers are joined), then the port listens. Any
failure on the way exits with one line naming the cause.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

import structlog

from config import Settings
from service.app import create_app, drain, load_engine
from service.connections import make_runner, start_site
from service.startup import (as_startup_error, bound_port, close_quietly, freeze_startup_heap, preflight,
                             run_until_stopped)

log = structlog.get_logger(__name__)


async def serve(settings: Settings, ready_message: bool = True, engine_factory=load_engine) -> None:
    """Serve until SIGTERM or SIGINT, then drain (running streams finish, up to the timeout) and exit.

    Raises StartupError (one line, the cause) if the port is taken, the model path or the
    discovery folder is wrong, or the engine or the cluster does not come up.
    """
    server = settings.server
    sock = preflight(server.host, server.port, server.model if engine_factory is load_engine else None,
                     settings.distributed.discovery_dir if settings.distributed.router == "dynamo" else None)
    if server.port == 0 and server.replica_id is None:  # named by the port it bound: two such replicas differ
        server.replica_id = f"{socket.gethostname()}:{bound_port(sock)}"
    app = create_app(settings, engine_factory)
    runner = make_runner(app, server.idle_timeout_s)
    try:
        await runner.setup()  # builds the engine, or joins the workers (app.py's lifetime)
        await start_site(runner, sock, server.max_connections_per_ip)
    except Exception as exc:
        sock.close()
        await close_quietly(runner.cleanup)
        raise as_startup_error(exc, server.host, server.port)
    url = f"http://{server.host}:{bound_port(sock)}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    freeze_startup_heap()
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
    """`pagedserve serve`: serve on uvloop until stopped; a failed start exits 1 with one line."""
    run_until_stopped(lambda: serve(settings, engine_factory=engine_factory), "the server")
