"""The aiohttp application: routes, typed state, and the engine's lifetime (cleanup_ctx)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from pathlib import Path

import structlog
from aiohttp import web
from redis.exceptions import RedisError

from config import Settings
from runtime.kv_events import KVEvent, net_hashes
from service.api.accounts import create_pin, delete_pin, list_pins, prefix_index_lookup, restore_pin, usage
from service.bridge.composition import load_engine, start_engine
from service.bridge.engine_bridge import EngineBridge
from service.bridge.protocols import EngineLike
from service.api import dashboard
from service.billing.journal import UsageJournal
from service.billing.ledger import RedisLedger, SQLiteLedger
from service.pins import RedisPinRegistry, SQLitePinRegistry
from service.prefix_index import MemoryPrefixIndex, RedisPrefixIndex
from service.rate_limit import LocalRateLimiter, RedisRateLimiter
from service.redis_pool import create_redis
from service.tenants import TenantDirectory
from service.connections import keep_alive_cap
from service.errors import APIError, error_middleware
from service.metrics import CONTENT_TYPE, ServiceMetrics
from service.api.completions import chat_completions, completions, list_models
from service.api.messages import count_tokens, messages
from service.api.responses import cancel_response, create_response, delete_response, get_response, list_input_items
from service.api.responses_socket import responses_websocket
from service.api.tokenize import detokenize, tokenize
from service.responses_store import RedisResponseStore, SQLiteResponseStore
from service.state import STATE, ServiceState
from service.api.websocket import websocket_stream

log = structlog.get_logger(__name__)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app.get(STATE)
    if state is None or not state.ready:
        return web.json_response({"status": "not ready"}, status=503)
    return web.json_response({"status": "ready", "model": state.model_name, "workers": state.bridge.num_workers})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: an operator's page. With tenants it needs an admin key, unless server.open_metrics
    opens it to anyone, without the series that name tenants (an admin key still gets them)."""
    state = request.app[STATE]
    with_tenants = state.tenants.is_open or _is_admin(state, request)
    if not with_tenants and not state.settings.server.open_metrics:
        raise APIError(403, "/metrics needs an admin key", None, "admin_key_required")
    body = state.metrics.render(with_tenants)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _is_admin(state, request: web.Request) -> bool:
    try:
        return state.authenticate(request).is_admin
    except APIError:
        if state.settings.server.open_metrics:
            return False
        raise


def build_stores(settings: Settings):
    """(ledger, pins, rate limiter, prefix index, redis client or None): Redis-backed when redis_url is set."""
    server = settings.server
    redis_url = server.redis_url or os.environ.get("REDIS_URL")
    if redis_url:
        if not server.cache_salt_secret:
            log.warning("redis_url is set but server.cache_salt_secret is not: each replica salts with its own "
                        "random secret, so the cluster prefix index cannot match across replicas or restarts")
        client = create_redis(redis_url)
        return RedisLedger(client), RedisPinRegistry(client), RedisRateLimiter(client), RedisPrefixIndex(client), client
    data_dir = Path(server.data_dir)
    return (SQLiteLedger(data_dir / "ledger.sqlite3"), SQLitePinRegistry(data_dir / "pins.sqlite3"), LocalRateLimiter(),
            MemoryPrefixIndex(), None)


def build_tenants(settings: Settings) -> TenantDirectory:
    server = settings.server
    secret = server.cache_salt_secret.encode() if server.cache_salt_secret else None
    if server.tenants_file:
        return TenantDirectory.from_file(server.tenants_file, secret)
    log.warning("no tenants file: the server is OPEN, every caller is tenant 'default' (set server.tenants_file)")
    return TenantDirectory.open(secret)


async def _publish_kv_events(state: ServiceState, pending: dict[bytes, bool], period_s: float = 0.1) -> None:
    """Send cached/evicted block hashes to the prefix index in batches; heartbeat the replica."""
    last_heartbeat = 0.0
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(period_s)
        batch: dict[bytes, bool] = {}
        try:
            if pending:
                batch = dict(pending)
                pending.clear()
                stored = [h for h, cached in batch.items() if cached]
                removed = [h for h, cached in batch.items() if not cached]
                await state.prefix_index.publish(state.replica_id, stored, removed)
                batch = {}
            if loop.time() - last_heartbeat > 5.0:
                await state.prefix_index.heartbeat(state.replica_id)
                last_heartbeat = loop.time()
        except (OSError, RedisError) as exc:
            for block_hash, cached in batch.items():  # keep the failed batch; newer events win
                pending.setdefault(block_hash, cached)
            log.warning("prefix index unreachable", error=str(exc))
            await asyncio.sleep(1.0)


def _feed_prefix_index(state: ServiceState, bridge: EngineBridge) -> asyncio.Task:
    """Hand the engine's KV events to the prefix index: the bridge collects, a task publishes in batches."""
    pending: dict[bytes, bool] = {}

    def on_kv_events(events: list[KVEvent]) -> None:
        stored, removed = net_hashes(events)
        pending.update(dict.fromkeys(stored, True))
        pending.update(dict.fromkeys(removed, False))

    bridge.on_kv_events = on_kv_events
    return asyncio.create_task(_publish_kv_events(state, pending))


async def _warm_up_grammars(state: ServiceState) -> None:
    """Index the vocabulary for structured outputs now, off the loop, not on the first constrained request."""
    try:
        await asyncio.get_running_loop().run_in_executor(None, state.engine.request_builder.grammars.warm_up)
    except Exception:  # structured outputs will then fail (400 naming the field) on their own; serving goes on
        log.exception("the grammar engine could not index the vocabulary")


async def _restore_pins(state: ServiceState) -> None:
    """Re-pin the registered prefixes (the pin registry survives restarts; the engine's pages do not)."""
    try:
        pins = await state.pins.list()
    except (OSError, RedisError) as exc:
        log.warning("pinned prefixes not restored: the store is unreachable", error=str(exc))
        return
    for pin in pins:
        try:
            await restore_pin(state, pin)
            log.info("pinned prefix restored", tenant=pin.tenant, pin_id=pin.pin_id)
        except Exception as exc:
            log.warning("pinned prefix not restored", tenant=pin.tenant, pin_id=pin.pin_id, error=str(exc))


def create_app(settings: Settings, engine_factory: Callable[[Settings], EngineLike] = load_engine) -> web.Application:
    """The service app. The engine is built at start-up (on its thread) and stopped at cleanup; with
    distributed.router = "dynamo" the app joins the workers' cluster instead."""
    app = web.Application(client_max_size=settings.server.max_body_bytes,
                          middlewares=[error_middleware, keep_alive_cap(settings.server.max_requests_per_connection)])

    async def lifetime(app: web.Application):
        tenants = build_tenants(settings)
        Path(settings.server.data_dir).mkdir(parents=True, exist_ok=True)  # the journal lives here, with Redis too
        ledger, pins, limiter, prefix_index, redis_client = build_stores(settings)
        journal = UsageJournal(Path(settings.server.data_dir) / "usage.journal", ledger)
        await journal.start()
        embedded = settings.distributed.router == "embedded"
        if embedded:
            engine, bridge = await start_engine(engine_factory, settings)
        else:  # workers behind Dynamo: their KV events go to Dynamo's indexer, not to our prefix index
            from service.distributed.front_door import DynamoBridge

            bridge, engine = await DynamoBridge.connect(settings)
            await prefix_index.close()
            prefix_index = None
        model_name = settings.server.served_model_name or engine.model_name
        replica_id = settings.server.replica_id or f"{socket.gethostname()}:{settings.server.port}"
        retention = settings.server.responses_retention_s
        responses = (RedisResponseStore(redis_client, retention) if redis_client is not None
                     else SQLiteResponseStore(Path(settings.server.data_dir) / "responses.sqlite3", retention))
        state = ServiceState(settings, engine, bridge, ServiceMetrics(lambda: bridge.stats, model_name), model_name, tenants,
                             ledger, journal, pins, limiter, prefix_index, replica_id, responses)
        app[STATE] = state
        publisher = _feed_prefix_index(state, bridge) if embedded else None
        bridge.start()
        await _restore_pins(state)
        state.spawn(_warm_up_grammars(state))
        if engine.tokenizer.chat_template.is_fallback:
            log.warning("the model has no chat template: chat uses 'role: content' lines, then 'assistant:'")
        log.info("serving", model=model_name, replica=replica_id, redis=redis_client is not None,
                 router=settings.distributed.router)
        yield
        await bridge.stop()
        if publisher is not None:
            publisher.cancel()
        await asyncio.gather(*(t for t in [publisher] if t), *state.background, return_exceptions=True)
        state.preprocessing.close()
        await journal.stop()
        await ledger.close()
        await pins.close()
        await responses.close()
        if prefix_index is not None:
            await prefix_index.close()
        if redis_client is not None:
            await redis_client.aclose()

    app.cleanup_ctx.append(lifetime)
    app.router.add_get("/v1/usage", usage)
    app.router.add_get("/v1/pinned-prefixes", list_pins)
    app.router.add_post("/v1/pinned-prefixes", create_pin)
    app.router.add_delete("/v1/pinned-prefixes/{pin_id}", delete_pin)
    app.router.add_get("/v1/prefix-index/lookup", prefix_index_lookup)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses", responses_websocket)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/stream", websocket_stream)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    dashboard.add_routes(app)
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
