"""The aiohttp application: routes, typed state, and the engine's lifetime (cleanup_ctx)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import structlog
from aiohttp import web

from config import Settings
from service.bridge import EngineBridge
from service.errors import error_middleware
from service.metrics import ServiceMetrics
from service.openai_api import chat_completions, completions, list_models
from service.state import STATE, ServiceState
from service.websocket import websocket_stream

log = structlog.get_logger(__name__)


def load_engine(settings: Settings):
    """Build the runtime Engine that the settings name (runs in a worker thread)."""
    from runtime import Engine

    engine_settings = {f: getattr(settings.engine, f) for f in settings.engine.__struct_fields__}
    return Engine.from_pretrained(settings.server.model, show_progress=True, **engine_settings)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app.get(STATE)
    if state is None or not state.ready:
        return web.json_response({"status": "not ready"}, status=503)
    return web.json_response({"status": "ready", "model": state.model_name})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def create_app(settings: Settings, engine_factory: Callable[[Settings], object] = load_engine) -> web.Application:
    """The service app. The engine is built at start-up (in a thread) and stopped at cleanup."""
    app = web.Application(client_max_size=settings.server.max_body_bytes, middlewares=[error_middleware])

    async def engine_lifetime(app: web.Application):
        engine = await asyncio.to_thread(engine_factory, settings)
        bridge = EngineBridge(engine, asyncio.get_running_loop())
        model_name = settings.server.served_model_name or getattr(engine, "model_name", Path(settings.server.model).name)
        app[STATE] = ServiceState(settings, engine, bridge, ServiceMetrics(lambda: bridge.stats), model_name)
        bridge.start()
        template = getattr(getattr(engine, "tokenizer", None), "chat_template", None)
        if template is not None and template.is_fallback:
            log.warning("the model has no chat template: chat uses 'role: content' lines, then 'assistant:'")
        log.info("serving", model=model_name)
        yield
        await bridge.stop()

    app.cleanup_ctx.append(engine_lifetime)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/stream", websocket_stream)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app


async def drain(app: web.Application, timeout_s: float) -> None:
    """Stop taking requests (/ready 503, new requests 503) and wait for running ones to end."""
    state = app[STATE]
    state.draining = True
    deadline = asyncio.get_running_loop().time() + timeout_s
    while state.bridge.num_inflight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if state.bridge.num_inflight:
        log.warning("shutdown timeout: aborting running requests", num_inflight=state.bridge.num_inflight)
