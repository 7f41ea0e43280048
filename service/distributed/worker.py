"""`pagedserve worker`: one engine served as a Dynamo endpoint, behind Dynamo's KV router.

    front door --Generate--> handle() --> EngineBridge (the same engine thread as `serve`)
               <--Output*, Done-- the request's RequestStream, a frame each time it gained news

A request stopped by its caller (Dynamo's context: cancel, disconnect) is aborted at once, so
its pages are free by the end of the next step. Every step's KV events go to Dynamo's
router (and, with `kv_events_endpoint`, out as vLLM-format ZMQ events). Its load goes to the
router (KV pages in use, pins and prefills included) and, with running and waiting requests,
to `/metrics` on the worker's small HTTP port (with `/health`, `/ready` and `/stats`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys

import msgspec
import structlog
from aiohttp import web

from config import Settings
from runtime.sampling_params import InvalidRequestError
from service.bridge.composition import load_engine, start_engine
from service.bridge.engine_bridge import EngineBridge
from service.bridge.protocols import EngineLike
from service.distributed import wire
from service.distributed.dynamo_runtime import create_runtime, endpoint_path, import_dynamo
from service.distributed.kv_publisher import DynamoKvPublisher
from service.grammars import LoopCompiles
from service.metrics import CONTENT_TYPE, ServiceMetrics
from service.startup import (as_startup_error, bound_port, close_quietly, freeze_startup_heap, preflight,
                             run_until_stopped)
from service.streams import RequestStream

log = structlog.get_logger(__name__)

LOAD_PERIOD_S = 0.1  # how often the worker's load goes to the router
HEARTBEAT_S = 2.0  # a request with no news this long sends a Waiting frame (front doors give up after worker_timeout_s)


async def _with_heartbeats(items, period_s: float):
    """`items`' values as they come, and None whenever `period_s` passes without one."""
    iterator = items.__aiter__()
    pending = asyncio.ensure_future(iterator.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait([pending], timeout=period_s)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(iterator.__anext__())
    finally:
        if not pending.done():
            pending.cancel()


class Worker:
    """Answers the front doors' calls (service.distributed.wire) with one engine."""

    def __init__(self, engine: EngineLike, bridge: EngineBridge, model_name: str) -> None:
        self.engine = engine
        self.bridge = bridge
        self.model_name = model_name
        self.grammars = LoopCompiles(engine.request_builder.grammars)

    async def handle(self, request, context):
        """Dynamo's handler: one call in, its frames out (builtins)."""
        try:
            call = wire.decode_call(request)
        except msgspec.ValidationError as exc:
            yield wire.encode(wire.Failure(f"malformed call: {exc}", invalid=True))
            return
        if isinstance(call, wire.Generate):
            async for frame in self._generate(call, context):
                yield wire.encode(frame)
        else:
            yield wire.encode(await self._query(call))

    async def _generate(self, call: wire.Generate, context):
        try:
            params = wire.params_of(call)
            grammar = await self.grammars.compile(params.structured_outputs)  # off this loop, as the front door
            request = self.engine.request_builder.prepare_request(
                call.request_id, call.prompt_token_ids, params, wire.salt_bytes(call.cache_salt),
                call.num_shared_blocks * self.engine.block_size, grammar=grammar, prediction=call.prediction_token_ids,
                tenant=call.tenant, tenant_weight=call.tenant_weight, priority=call.priority)
        except InvalidRequestError as exc:
            yield wire.failure_of(exc)
            return
        except msgspec.ValidationError as exc:
            yield wire.Failure(str(exc), invalid=True)
            return
        stream = RequestStream(request.request_id, len(request.prompt_token_ids), request.params.n)
        self.bridge.submit(stream, request)
        watcher = asyncio.ensure_future(self._abort_when_stopped(context, request.request_id))
        try:
            async for deltas in _with_heartbeats(stream.deltas(), HEARTBEAT_S):
                if deltas is None:
                    yield wire.Waiting()
                else:
                    yield wire.Output([wire.choice_of(d) for d in deltas], stream.num_cached_tokens,
                                      stream.num_accepted_prediction_tokens, stream.num_cache_written_tokens)
            yield wire.Done(stream.num_cached_tokens, stream.num_accepted_prediction_tokens,
                            stream.num_cache_written_tokens)
        except Exception as exc:  # the engine failed the request (stream.fail)
            log.warning("request failed on the worker", request_id=request.request_id, error=repr(exc))
            yield wire.Failure(f"the worker's engine failed the request: {exc}")
        finally:
            watcher.cancel()
            self.bridge.abort(request.request_id)  # no-op once finished; frees the pages if the caller left

    async def _abort_when_stopped(self, context, request_id: str) -> None:
        await context.async_killed_or_stopped()
        log.info("request stopped by its caller", request_id=request_id)
        self.bridge.abort(request_id)

    async def _query(self, call: wire.Call) -> wire.Frame:
        try:
            if isinstance(call, wire.Describe):
                limits = dataclasses.asdict(self.engine.limits)
                return wire.Reply({"model_name": self.model_name, "limits": limits})
            if isinstance(call, wire.Stats):
                return wire.Reply(self.bridge.stats)
            if isinstance(call, wire.PageMap):
                return wire.Reply(await self.bridge.page_map())
            if isinstance(call, wire.Pin):
                return wire.Reply(await self.bridge.pin(call.pin_id, call.prompt_token_ids,
                                                        wire.salt_bytes(call.cache_salt), call.shared_prefix_len))
            if isinstance(call, wire.Unpin):
                return wire.Reply(await self.bridge.unpin(call.pin_id))
        except InvalidRequestError as exc:
            return wire.failure_of(exc)
        except Exception as exc:
            log.exception("worker call failed", call=type(call).__name__)
            return wire.Failure(f"{type(call).__name__} failed on the worker: {exc}")
        raise TypeError(f"unhandled call {call!r}")  # every Call type is handled above


def _probe_app(bridge: EngineBridge, metrics: ServiceMetrics, registered: asyncio.Event) -> web.Application:
    """/health, /ready, /metrics and /stats (the engine's JSON stats) on the worker's probe port.

    /ready answers 503 until the worker is registered with Dynamo (and while its engine is unhealthy).
    """
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(request: web.Request) -> web.Response:
        if not registered.is_set():
            return web.json_response({"status": "not ready", "reason": "not registered with Dynamo"}, status=503)
        if not bridge.healthy:
            return web.json_response({"status": "not ready"}, status=503)
        return web.json_response({"status": "ready"})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(bridge.stats)

    async def render(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", render)
    app.router.add_get("/stats", stats)
    return app


async def _publish_load(bridge: EngineBridge, publisher) -> None:
    while True:
        stats = bridge.stats
        try:
            publisher.publish(0, stats["num_used_blocks"], stats["num_used_blocks"])
        except Exception as exc:  # the router's view goes stale; serving goes on
            log.warning("worker load not published", error=repr(exc))
        await asyncio.sleep(LOAD_PERIOD_S)


async def serve_worker(settings: Settings, engine_factory=load_engine) -> None:
    """Run a worker until SIGTERM or SIGINT.

    Start-up is all or nothing, in this order: take the probe port, check the model path and
    the discovery folder, build the engine, open the probes; only then join Dynamo (serve the
    endpoint, register the model). A failure at any step undoes the ones before it (nothing
    stays registered) and raises StartupError naming the cause.

    On the signal it leaves discovery first (the router stops sending), lets what runs finish
    (up to server.shutdown_timeout_s), then stops.
    """
    loop = asyncio.get_running_loop()
    dist = settings.distributed
    host = settings.server.host
    sock = preflight(host, dist.worker_port, settings.server.model if engine_factory is load_engine else None,
                     dist.discovery_dir)  # the port is ours before the model loads; 0: a free one
    try:
        core = import_dynamo()
        engine, bridge = await start_engine(engine_factory, settings)
    except Exception as exc:
        sock.close()
        raise as_startup_error(exc, host, dist.worker_port)
    model_name = settings.server.served_model_name or engine.model_name
    registered = asyncio.Event()
    runner = web.AppRunner(_probe_app(bridge, ServiceMetrics(lambda: bridge.stats, model_name), registered),
                           access_log=None)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
    except Exception as exc:
        sock.close()
        await close_quietly(bridge.stop, runner.cleanup)
        raise as_startup_error(exc, host, dist.worker_port)
    probes = f"http://{host}:{bound_port(sock)}"
    log.info("listening", url=probes)  # the probe port (its own choice with --port 0)
    joined = await _join_dynamo(core, loop, settings, engine, bridge, model_name, runner)
    runtime, endpoint, serving, load_task, publishers = joined
    registered.set()
    freeze_startup_heap()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("worker serving", model=model_name, worker_id=endpoint.connection_id(), endpoint=endpoint_path(dist.namespace),
             probes=probes, discovery_dir=dist.discovery_dir)
    print(f"pagedserve worker {endpoint.connection_id()} is serving {model_name!r}; probes at {probes}",
          file=sys.stderr, flush=True)
    done, _ = await asyncio.wait([asyncio.ensure_future(stop.wait()), serving], return_when=asyncio.FIRST_COMPLETED)
    if serving in done and serving.exception() is not None:
        log.error("the endpoint stopped", error=repr(serving.exception()))
    log.info("worker stopping: leaving discovery, then draining", num_inflight=bridge.num_inflight)
    await _leave_discovery(core, endpoint)
    deadline = loop.time() + settings.server.shutdown_timeout_s
    while bridge.num_inflight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    load_task.cancel()
    await bridge.stop()
    for publisher in publishers:
        publisher.close()
    await runner.cleanup()
    runtime.shutdown()
    log.info("worker stopped")


ENDPOINT_START_S = 0.2  # how long the endpoint must keep serving after registration to count as started


async def _join_dynamo(core, loop, settings: Settings, engine, bridge: EngineBridge, model_name: str, runner):
    """Serve the endpoint and register the model: (runtime, endpoint, serving task, load task, publishers).

    On any failure, what was registered is removed and the runtime shut down before
    StartupError is raised: a worker that did not start is never routed to.
    """
    dist = settings.distributed
    runtime = endpoint = serving = load_task = None
    publishers: list = []
    try:
        runtime = create_runtime(loop, dist.discovery_dir)
        endpoint = runtime.endpoint(endpoint_path(dist.namespace))
        publishers = _kv_publishers(endpoint, engine.block_size, settings)
        bridge.on_kv_events = lambda events: [publisher.publish(events) for publisher in publishers]
        bridge.start()
        load_publisher = core.WorkerMetricsPublisher()
        await load_publisher.create_endpoint(endpoint)
        load_task = asyncio.create_task(_publish_load(bridge, load_publisher))
        worker = Worker(engine, bridge, model_name)
        serving = asyncio.ensure_future(endpoint.serve_endpoint(worker.handle, graceful_shutdown=False))
        await _register(core, endpoint, settings, engine, model_name)
        done, _ = await asyncio.wait([serving], timeout=ENDPOINT_START_S)
        if serving in done:  # serving ended at once: its error, or a plain stop, is a failed start
            raise serving.exception() or RuntimeError("the Dynamo endpoint stopped as soon as it started")
        return runtime, endpoint, serving, load_task, publishers
    except Exception as exc:
        error = as_startup_error(exc)
        if endpoint is not None:
            await _leave_discovery(core, endpoint)
        for task in (serving, load_task):
            if task is not None:
                task.cancel()
        for publisher in publishers:
            publisher.close()
        await close_quietly(bridge.stop, runner.cleanup)
        if runtime is not None:
            runtime.shutdown()  # also deletes the discovery files this process wrote
        raise error from None


async def _leave_discovery(core, endpoint) -> None:
    """Unregister the model and the endpoint instance (best effort: the TTL removes what is left)."""
    try:
        await core.unregister_model(endpoint)
        await endpoint.unregister_endpoint_instance()
    except Exception as exc:
        log.warning("could not unregister from discovery", error=repr(exc))


def _kv_publishers(endpoint, block_size: int, settings: Settings) -> list:
    """Dynamo's KV event publisher, and the vLLM-format ZMQ one when kv_events_endpoint is set."""
    dist = settings.distributed
    publishers = [DynamoKvPublisher(endpoint, block_size)]
    if dist.kv_events_endpoint:
        from service.distributed.vllm_events import VllmEventPublisher

        publishers.append(VllmEventPublisher(dist.kv_events_endpoint, dist.kv_events_replay_endpoint,
                                             dist.kv_events_topic, block_size))
    return publishers


async def _register(core, endpoint, settings: Settings, engine, model_name: str) -> None:
    """Advertise the model on the endpoint, with the sizes Dynamo's router plans with."""
    config = core.ModelRuntimeConfig()
    config.total_kv_blocks = engine.limits.num_schedulable_blocks
    config.max_num_seqs = settings.engine.max_num_seqs
    config.max_num_batched_tokens = settings.engine.max_num_batched_tokens
    config.context_length = engine.max_model_len
    await core.register_model(core.ModelInput.Tokens, core.ModelType.Chat | core.ModelType.Completions, endpoint,
                              settings.server.model, model_name, worker_type=core.WorkerType.Aggregated,
                              kv_cache_block_size=engine.block_size, runtime_config=config, skip_model_assets=True)


def run_worker(settings: Settings) -> None:
    """`pagedserve worker`: serve until stopped; a failed start exits 1 with one line naming the cause."""
    run_until_stopped(lambda: serve_worker(settings), "the worker")
