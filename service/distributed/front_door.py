"""`pagedserve serve --router dynamo`: the front door's bridge to workers behind Dynamo.

`DynamoBridge` has EngineBridge's interface (submit, abort, pin, unpin, page_map, stats), so
the service around it (auth, tenants, limits, templates, SSE, the WebSocket, billing) is the
same as in the embedded server. Each request goes to one worker, picked by the routing policy
(service/distributed/routing.py: kv, round_robin or random), then streams from it
(Client.direct). A worker that cannot be reached, or breaks, before its
first frame costs the request a new route (3 tries), and that worker is left out of every
pick until discovery drops it: a killed worker's entry expires with Dynamo's file-discovery
TTL (10 s, kept alive every ~3 s by a live process). A worker lost mid-stream fails its
streams (an error event and [DONE]). Every such failure, and no worker at all, is
UnavailableError: 503 with Retry-After, never a 500.

`RemoteModel` is the loop-side part of an engine: the checkpoint's tokenizer and the workers'
limits (asked of a worker at start-up), so requests are validated before they leave.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog

from config import Settings
from runtime.request import Request
from runtime.request_builder import RequestBuilder, RequestLimits
from runtime.sampling_params import InvalidRequestError
from runtime.tokenizer import load_tokenizer
from service.bridge.streams_in_flight import StreamsInFlight
from service.distributed import wire
from service.distributed.dynamo_runtime import create_runtime, endpoint_path, import_dynamo
from service.distributed.routing import Routing, make_routing
from service.errors import UnavailableError
from service.startup import StartupError
from service.streams import RequestStream

log = structlog.get_logger(__name__)

POLL_PERIOD_S = 0.5  # how often worker stats are gathered (and new workers get the pins)
CALL_TIMEOUT_S = 10.0  # a one-shot call (stats, pin, describe) to one worker
MAX_ROUTE_ATTEMPTS = 3  # workers tried for one request before its first frame
LOST_WORKER_TTL_S = 15.0  # a worker that failed is skipped this long: past discovery's TTL, so until it is dropped
STAT_SUMS = ("num_blocks", "num_free_blocks", "num_used_blocks", "num_cached_blocks", "num_kv_tokens", "num_running",
             "num_waiting", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_pinned_blocks",
             "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class WorkerLost(UnavailableError):
    """No worker could take the request, or its worker's stream broke or ended before the request did."""


class RemoteModel:
    """What the loop asks of an engine (service.bridge.protocols.ModelLike), for a model served by workers: the
    checkpoint's tokenizer and the workers' limits, so requests are validated before they leave (the
    worker checks again)."""

    def __init__(self, model_name: str, tokenizer, limits: RequestLimits) -> None:
        self.request_builder = RequestBuilder(tokenizer, limits)
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_name = model_name
        self.max_model_len = limits.max_model_len
        self.block_size = limits.block_size


def sum_stats(per_worker: list[dict]) -> dict:
    """The cluster's engine stats: counters and page counts summed over workers."""
    total = {key: sum(stats.get(key, 0) for stats in per_worker) for key in STAT_SUMS}
    total["block_size"] = per_worker[0]["block_size"] if per_worker else 0
    per_position = [stats.get("spec_decode_accepted_per_position", []) for stats in per_worker]
    total["spec_decode_accepted_per_position"] = [sum(counts[i] for counts in per_position if i < len(counts))
                                                  for i in range(max(map(len, per_position), default=0))]
    tenants: dict[str, dict] = {}  # per tenant, summed over workers (each worker keeps its own fair counters)
    for stats in per_worker:
        for tenant, row in stats.get("tenants", {}).items():
            merged = tenants.setdefault(tenant, dict.fromkeys(row, 0))
            for key, value in row.items():  # a worker's own counter is its own: the largest is shown
                merged[key] = max(merged.get(key, 0), value) if key in ("weight", "virtual_tokens") \
                    else merged.get(key, 0) + value
    total["tenants"] = tenants
    total["scheduling"] = per_worker[0].get("scheduling", "fcfs") if per_worker else "fcfs"
    return total


class DynamoBridge(StreamsInFlight):
    """EngineBridge's interface, each request sent to the worker Dynamo picks (see the module docstring)."""

    def __init__(self, runtime, client, routing: Routing, loop: asyncio.AbstractEventLoop,
                 stall_timeout_s: float = 60.0) -> None:
        self._runtime = runtime
        self.stall_timeout_s = stall_timeout_s  # a worker silent this long (no frame, not even Waiting) is lost
        self._client = client
        self.routing = routing  # who picks each request's worker
        self.loop = loop
        self.streams: dict[str, RequestStream] = {}
        self.stats: dict = sum_stats([])
        self.on_kv_events = None  # the workers publish their own KV events (to Dynamo)
        self._contexts: dict[str, object] = {}  # request id -> Dynamo Context (stop_generating cancels)
        self._tasks: set[asyncio.Task] = set()
        self._pins: dict[str, wire.Pin] = {}  # every pin, replayed on workers that join
        self._pinned_on: dict[int, set[str]] = {}
        self._lost: dict[int, float] = {}  # worker id -> when it failed
        self._poller: asyncio.Task | None = None

    # --- start-up -----------------------------------------------------------------------

    @classmethod
    async def connect(cls, settings: Settings) -> tuple[DynamoBridge, RemoteModel]:
        """Join the cluster in settings.distributed, wait for a worker, ask it for the model's limits."""
        core = import_dynamo()
        dist = settings.distributed
        loop = asyncio.get_running_loop()
        runtime = create_runtime(loop, dist.discovery_dir)
        endpoint = runtime.endpoint(endpoint_path(dist.namespace))
        client = await endpoint.client()
        log.info("waiting for workers", endpoint=endpoint_path(dist.namespace), discovery_dir=dist.discovery_dir,
                 timeout_s=dist.worker_timeout_s)
        try:
            async with asyncio.timeout(dist.worker_timeout_s):
                worker_ids = await client.wait_for_instances()
            reply = await _call(client, wire.Describe(), worker_ids[0])
        except TimeoutError:
            runtime.shutdown()
            raise StartupError(f"no pagedserve worker answered at {endpoint_path(dist.namespace)} "
                               f"(discovery: {dist.discovery_dir}; waited up to {dist.worker_timeout_s} s for one, "
                               f"{CALL_TIMEOUT_S} s for its limits)") from None
        except BaseException:
            runtime.shutdown()
            raise
        limits = RequestLimits(**reply["limits"])
        model = RemoteModel(reply["model_name"], load_tokenizer(settings.server.model), limits)
        routing = make_routing(dist.routing, core, endpoint, limits.block_size, dist.kv_prefill_load_scale)
        log.info("front door connected", workers=len(worker_ids), routing=routing.name, model=model.model_name)
        return cls(runtime, client, routing, loop, stall_timeout_s=dist.worker_timeout_s), model

    def start(self) -> None:
        self._poller = self.loop.create_task(self._poll())

    # --- the bridge interface -----------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return bool(self.live_workers())

    @property
    def num_workers(self) -> int:
        return len(self.live_workers())

    def live_workers(self) -> list[int]:
        """Workers in discovery that have not failed lately, in id order."""
        now = time.monotonic()
        return sorted(w for w in self._client.instance_ids() if now - self._lost.get(w, -LOST_WORKER_TTL_S)
                      >= LOST_WORKER_TTL_S)

    def submit(self, stream: RequestStream, request: Request) -> None:
        """Register the stream and route its request; returns at once."""
        self.streams[stream.request_id] = stream
        task = self.loop.create_task(self._run(stream, request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abort(self, request_id: str) -> None:
        """Stop a request: its worker aborts it (pages free by the end of its next step)."""
        stream = self.streams.pop(request_id, None)
        context = self._contexts.pop(request_id, None)
        if context is not None:
            context.stop_generating()
        if stream is not None and not stream.finished:
            stream.close("abort")

    async def pin(self, pin_id: str, prompt_token_ids: list[int], cache_salt: bytes | None,
                  shared_prefix_len: int = 0) -> int:
        """Pin the prefix on every worker (and on workers that join later).

        Every worker, not only the one the router prefers: a pinned prefix is a tenant's hot
        system prompt, and with it resident everywhere the router can place that tenant's
        requests by load alone without losing the hit. It costs the pin's pages once per worker.
        Raises the first worker's InvalidRequestError (e.g. the pin budget), or WorkerLost (a 503)
        if no worker took it; the workers that did take it keep it until unpin. Only a pin that was
        placed is replayed on workers that join. Returns the fewest tokens any worker found cached (the
        prefill the tenant is billed for is the most any worker computed).
        """
        call = wire.Pin(pin_id, prompt_token_ids, wire.salt_hex(cache_salt), shared_prefix_len)
        workers = self.live_workers()
        results = await asyncio.gather(*(self._pin_on(w, call) for w in workers), return_exceptions=True)
        for worker_id, result in zip(workers, results):
            if isinstance(result, Exception):
                log.warning("pin not placed on a worker", worker_id=worker_id, pin_id=pin_id, error=repr(result))
        invalid = next((r for r in results if isinstance(r, InvalidRequestError)), None)
        if invalid is not None:
            raise invalid
        placed = [result for result in results if not isinstance(result, Exception)]
        if not placed:
            raise WorkerLost(f"the pin {pin_id!r} was placed on no worker (none is reachable)")
        self._pins[pin_id] = call
        return min(result if isinstance(result, int) and not isinstance(result, bool) else 0 for result in placed)

    async def _pin_on(self, worker_id: int, call: wire.Pin) -> int:
        num_cached = await _call(self._client, call, worker_id)
        self._pinned_on.setdefault(worker_id, set()).add(call.pin_id)
        return num_cached

    async def unpin(self, pin_id: str) -> bool:
        """Unpin on every worker; True if any held it."""
        self._pins.pop(pin_id, None)
        workers = self.live_workers()
        results = await asyncio.gather(*(_call(self._client, wire.Unpin(pin_id), w) for w in workers),
                                       return_exceptions=True)
        for worker_id in workers:
            self._pinned_on.get(worker_id, set()).discard(pin_id)
        return any(result is True for result in results)

    async def page_map(self) -> dict:
        """The page map of the first live worker (the dashboard shows one engine's pages)."""
        workers = self.live_workers()
        if not workers:
            raise WorkerLost("no worker is reachable")
        try:
            snapshot = await _call(self._client, wire.PageMap(), workers[0])
        except Exception as exc:  # a timeout, its Failure, or Dynamo's transport errors (plain Exceptions)
            raise WorkerLost(f"worker {workers[0]} did not send its page map: {exc}") from exc
        snapshot["worker_id"] = workers[0]
        return snapshot

    async def overlap_blocks(self, token_ids: list[int], cache_salt: bytes | None, num_shared_blocks: int) -> dict:
        """Per worker, how many leading blocks of the prompt Dynamo's indexer says it holds ({} unless kv routing)."""
        try:
            return await self.routing.overlap_blocks(token_ids, cache_salt, num_shared_blocks)
        except Exception as exc:  # the router knows no worker now
            raise WorkerLost(f"the KV router could not score the prompt: {exc}") from exc

    async def stop(self) -> None:
        """Abort everything in flight and leave the cluster."""
        for request_id in list(self.streams):
            self.abort(request_id)
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*self._tasks, *(t for t in [self._poller] if t), return_exceptions=True)
        self._runtime.shutdown()

    # --- one request ----------------------------------------------------------------------

    async def _run(self, stream: RequestStream, request: Request) -> None:
        request_id = request.request_id
        call = wire.encode(wire.generate_call(request))
        try:
            for _ in range(MAX_ROUTE_ATTEMPTS):
                context = import_dynamo().Context(request_id)  # one per attempt: a stalled one's stop stays its own
                self._contexts[request_id] = context
                if request_id not in self.streams or await self._stream_once(stream, request, call, context):
                    return  # aborted, or the worker ended it
            stream.fail(WorkerLost(f"no worker could be reached in {MAX_ROUTE_ATTEMPTS} attempts"))
        except Exception as exc:  # no worker at all, a lost worker, a malformed frame: the stream must end (503)
            log.warning("request failed in the front door", request_id=request_id, error=repr(exc))
            if not stream.finished:
                stream.fail(exc if isinstance(exc, (WorkerLost, InvalidRequestError)) else
                            WorkerLost(f"routing failed: {exc}"))
        finally:
            self.streams.pop(request_id, None)
            self._contexts.pop(request_id, None)

    async def _stream_once(self, stream: RequestStream, request: Request, call: dict, context) -> bool:
        """Send the request to one worker and relay its frames. True: it ended (or was aborted);
        False: the worker could not be reached or broke before its first frame, route again.

        Only the transport counts against the worker (Dynamo raises plain Exceptions for a worker
        it cannot reach or lost); a malformed frame fails the request. Raises WorkerLost when the
        worker broke after its first frame.
        """
        request_id = request.request_id
        worker_id, tracked = await self.routing.pick(request, self.live_workers())
        got_frame = False
        try:
            if request_id not in self.streams:
                return True  # aborted while routing: nothing sent
            try:
                async with asyncio.timeout(self.stall_timeout_s):
                    frames = await self._open(call, worker_id, context)
            except TimeoutError:
                context.stop_generating()
                return self._lose(worker_id, request_id,
                                  WorkerLost(f"the worker did not take the request in {self.stall_timeout_s:g} s"), False)
            except Exception as exc:
                return self._lose(worker_id, request_id, exc, got_frame)
            while True:
                try:
                    async with asyncio.timeout(self.stall_timeout_s):
                        item = await anext(frames, None)
                except TimeoutError:  # stalled (stopped, partitioned): give it up; if it wakes, it drops the request
                    context.stop_generating()
                    return self._lose(worker_id, request_id,
                                      WorkerLost(f"the worker sent nothing for {self.stall_timeout_s:g} s"), got_frame)
                except Exception as exc:
                    return self._lose(worker_id, request_id, exc, got_frame)
                if item is None:
                    break
                data = item.data()
                if data is None:
                    continue
                frame = wire.decode_frame(data)
                if isinstance(frame, wire.Waiting):
                    continue  # alive, no news: neither a first frame nor a token
                if not got_frame and tracked:
                    await self.routing.prefill_done(request_id)
                got_frame = True
                if isinstance(frame, wire.Failure):
                    stream.fail(wire.failure_error(frame))
                    return True
                if request_id not in self.streams:
                    return True  # aborted: the stop signal is on its way to the worker
                done = isinstance(frame, wire.Done)
                stream.push(wire.request_output(request_id, request.prompt_token_ids, frame, done), time.monotonic())
                if done:
                    return True
            if request_id not in self.streams:
                return True
            return self._lose(worker_id, request_id, WorkerLost("its stream ended before the request did"), got_frame)
        finally:
            if tracked:
                try:
                    await self.routing.release(request_id)
                except Exception as exc:  # the router's count goes stale; the answer stands
                    log.warning("router free failed", request_id=request_id, error=repr(exc))

    def _lose(self, worker_id: int | None, request_id: str, error: Exception, got_frame: bool) -> bool:
        """Note a worker that failed this request: False (route again), or WorkerLost after its first frame."""
        if request_id not in self.streams:
            return True  # aborted meanwhile: nothing to route
        if worker_id is not None:
            self._lost[worker_id] = time.monotonic()
        log.warning("worker lost", worker_id=worker_id, request_id=request_id, after_first_frame=got_frame,
                    error=str(error))
        if got_frame:
            raise WorkerLost(f"the worker serving this request was lost: {error}") from error
        return False

    async def _open(self, call: dict, worker_id: int | None, context):
        if worker_id is not None:
            return await self._client.direct(call, worker_id, context=context)
        return await self.routing.open_unpicked(self._client, call, context)

    # --- background: stats and pins -------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            try:
                await self._poll_once()
            except Exception as exc:
                log.warning("worker poll failed", error=repr(exc))
            await asyncio.sleep(POLL_PERIOD_S)

    async def _poll_once(self) -> None:
        workers = self.live_workers()
        listed = set(self._client.instance_ids())
        for worker_id in [w for w in self._lost if w not in listed]:
            del self._lost[worker_id]  # discovery dropped it
        for worker_id in [w for w in self._pinned_on if w not in listed]:
            del self._pinned_on[worker_id]
        results = await asyncio.gather(*(_call(self._client, wire.Stats(), w) for w in workers),
                                       return_exceptions=True)
        self.stats = {**sum_stats([r for r in results if isinstance(r, dict)]), "num_workers": len(workers)}
        for worker_id in workers:
            missing = [call for pin_id, call in self._pins.items() if pin_id not in self._pinned_on.get(worker_id, ())]
            for call in missing:  # a worker that joined (or restarted) gets every pin
                try:
                    await self._pin_on(worker_id, call)
                    log.info("pin placed on a new worker", worker_id=worker_id, pin_id=call.pin_id)
                except Exception as exc:
                    log.warning("pin not placed on a new worker", worker_id=worker_id, pin_id=call.pin_id,
                                error=repr(exc))


async def _call(client, message: msgspec.Struct, worker_id: int):
    """One-shot call to one worker: its Reply's value; raises InvalidRequestError or RuntimeError on Failure."""
    async with asyncio.timeout(CALL_TIMEOUT_S):
        frames = await client.direct(wire.encode(message), worker_id)
        async for item in frames:
            data = item.data()
            if data is None:
                continue
            frame = wire.decode_frame(data)
            if isinstance(frame, wire.Reply):
                return frame.value
            if isinstance(frame, wire.Failure):
                raise wire.failure_error(frame)
    raise RuntimeError(f"worker {worker_id} sent no reply to {type(message).__name__}")



