"""A real server on a random loopback port, run on its own thread and uvloop."""

import asyncio
import hashlib
import json
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvloop
from aiohttp import web

from config import load_settings
from service.app import create_app, load_engine
from service.state import STATE


class TokenCounter:
    """Tokens the engine sampled (every step's new_token_ids), counted on the engine thread."""

    def __init__(self) -> None:
        self.value = 0


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
    def counting_engine_tokens(self):
        """Count what the engine itself generates (not what reached a client) while the block runs."""
        engine = self.state.bridge.engine
        real_step = engine.step
        own = "step" in vars(engine)
        counter = TokenCounter()

        def step():
            outputs = real_step()
            counter.value += sum(len(c.new_token_ids) for output in outputs for c in output.outputs)
            return outputs

        engine.step = step
        try:
            yield counter
        finally:
            if own:
                engine.step = real_step
            else:
                del engine.step


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


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def _toml_key(key: str) -> str:
    return key if key.replace("-", "_").isidentifier() else json.dumps(key)


def _toml_table(header: str, values: dict) -> list[str]:
    """`[header]` and its values, then a `[header.key]` table for each dict value (e.g. a plan's models)."""
    scalars = {k: v for k, v in values.items() if not isinstance(v, dict)}
    lines = []
    if scalars or not values:  # a table of only sub-tables needs no header of its own
        lines = [f"[{header}]", *(f"{k} = {_toml_value(v)}" for k, v in scalars.items()), ""]
    for key, value in values.items():
        if isinstance(value, dict):
            lines += _toml_table(f"{header}.{_toml_key(key)}", value)
    return lines


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_tenants_file(path, tenants: dict[str, dict], plans: dict[str, dict] | None = None,
                       admin_keys: list[str] = (), shared_prefixes: list[dict] = ()) -> Path:
    """Write a tenants TOML file (the schema in service/tenants.py) and return its path.

    tenants: id -> {"keys": [plain API keys], "plan": ..., optional limits}; keys are stored as sha256,
    as are admin_keys. plans: name -> prices (default: one "standard" plan at 0.50 / 0.05 / 1.50 USD
    per million tokens). shared_prefixes: [{"name": ..., "text": ...}].
    """
    if plans is None:
        plans = {"standard": {"input_per_mtok": 0.50, "cached_input_per_mtok": 0.05, "output_per_mtok": 1.50}}
    lines = []
    if admin_keys:
        lines += [f"admin_keys_sha256 = {_toml_value([sha256_hex(k) for k in admin_keys])}", ""]
    for name, prices in plans.items():
        lines += _toml_table(f"plans.{_toml_key(name)}", prices)
    for tenant_id, config in tenants.items():
        config = dict(config)
        keys = config.pop("keys")
        lines += _toml_table(f"tenants.{_toml_key(tenant_id)}", {"keys_sha256": [sha256_hex(k) for k in keys], **config})
    for prefix in shared_prefixes:
        lines += ["[[shared_prefixes]]", *(f"{k} = {_toml_value(v)}" for k, v in prefix.items()), ""]
    path = Path(path)
    path.write_text("\n".join(lines))
    return path
