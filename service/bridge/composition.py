"""The engine built on its own thread (where it will step), and its bridge on the running loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from service.bridge.engine_bridge import EngineBridge
from service.bridge.engine_thread import EngineThread
from service.bridge.protocols import EngineLike


def load_engine(settings) -> EngineLike:
    """Build the runtime Engine that the settings name (run it on the engine thread, where it will step)."""
    from runtime import Engine

    engine_settings = {f: getattr(settings.engine, f) for f in settings.engine.__struct_fields__}
    engine = Engine.from_pretrained(settings.server.model, show_progress=True, **engine_settings)
    engine.trace_requests = settings.server.trace_requests
    return engine


async def start_engine(engine_factory: Callable, settings, kv_events: bool = True) -> tuple[EngineLike, EngineBridge]:
    """Build the engine with `engine_factory(settings)` on a new EngineThread, and its bridge on this loop.

    The bridge is not started: set on_kv_events first if needed, then call start().
    """
    thread = EngineThread()
    try:
        engine = await thread.call(engine_factory, settings)
    except BaseException:
        thread.close()
        raise
    return engine, EngineBridge(engine, asyncio.get_running_loop(), kv_events=kv_events, thread=thread)
