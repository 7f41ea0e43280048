"""The embedded engine's bridge between the event loop and the engine thread.

The engine thread is the only owner of runtime state. The loop talks to it through a
thread-safe inbox of commands (add, abort); the thread drains the inbox between steps,
runs `engine.step()`, and hands each step's outputs back to the loop once per step with
`loop.call_soon_threadsafe`. On the loop, outputs are fanned out to per-request streams.

    loop                          engine thread
    submit() --add-->  inbox  --> drain -> engine.add_request
    abort()  --abort-> inbox  --> drain -> engine.abort_request
    _deliver(outputs) <-- call_soon_threadsafe -- engine.step()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable

import structlog

from runtime.kv_events import KVEvent
from runtime.outputs import RequestOutput
from runtime.request import Request
from service.bridge.commands import STOP, Abort, Add, PageMap, Pin, Unpin, settle
from service.bridge.engine_thread import EngineThread
from service.bridge.protocols import EngineLike
from service.bridge.streams_in_flight import StreamsInFlight
from service.streams import RequestStream

log = structlog.get_logger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle engine thread blocks on the inbox before looking again
MAX_UNDELIVERED_STEPS = 2  # the engine thread waits when the loop is this many steps behind
STATS_PERIOD_S = 0.05  # engine stats ride along with a step's outputs at most this often (and when idle)


class EngineBridge(StreamsInFlight):
    """Runs the engine on its own thread; streams its outputs to asyncio consumers."""

    def __init__(self, engine: EngineLike, loop: asyncio.AbstractEventLoop, kv_events: bool = False,
                 thread: EngineThread | None = None) -> None:
        self.engine = engine
        self.loop = loop
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, RequestStream] = {}  # loop side: live streams by request id
        self.stats: dict = engine.stats()  # latest snapshot, replaced once per step
        self.healthy = True
        self._stats_at = 0.0  # engine thread: when stats were last taken
        self._pin_futures: dict[str, asyncio.Future] = {}  # engine thread: pin prefill id -> loop future
        self._thread = thread or EngineThread()  # pass the thread that built the engine
        self._running: concurrent.futures.Future | None = None
        self._stop_event = threading.Event()
        self._undelivered = threading.BoundedSemaphore(MAX_UNDELIVERED_STEPS)  # backpressure from the loop
        self.on_kv_events: Callable[[list[KVEvent]], None] | None = None  # loop side, each step's events
        self.kv_events = kv_events
        if kv_events:
            engine.record_kv_events()

    # --- loop side ----------------------------------------------------------------------

    def start(self) -> None:
        self._running = self._thread.submit(self._run)

    def submit(self, stream: RequestStream, request: Request) -> None:
        """Register the stream and send its request (from engine.request_builder.prepare_request) to the engine;
        returns at once."""
        self.streams[stream.request_id] = stream
        self.inbox.put(Add(stream, request))

    async def pin(self, pin_id: str, prompt_token_ids: list[int], cache_salt: bytes | None,
                  shared_prefix_len: int = 0) -> int:
        """Prefill a prefix and hold its pages (engine.pin_prefix); once they are pinned, the prefill's cached
        tokens (the rest were computed: its tenant's bill).

        Raises what the engine raised (e.g. the pin budget) or RuntimeError if the prefill was stopped.
        """
        done = self.loop.create_future()
        self.inbox.put(Pin(pin_id, prompt_token_ids, cache_salt, shared_prefix_len, done))
        return await done

    async def unpin(self, pin_id: str) -> bool:
        done = self.loop.create_future()
        self.inbox.put(Unpin(pin_id, done))
        return await done

    async def page_map(self) -> dict:
        """engine.page_map(), taken on the engine thread between steps."""
        done = self.loop.create_future()
        self.inbox.put(PageMap(done))
        return await done

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages are free by the end of the engine's next step."""
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self.inbox.put(Abort(request_id))
            stream.close("abort")

    @property
    def num_workers(self) -> int:
        return 1

    async def stop(self) -> None:
        """Abort everything still running and join the engine thread."""
        for request_id in list(self.streams):
            self.abort(request_id)
        self._stop_event.set()
        self.inbox.put(STOP)
        if self._running is not None:
            await asyncio.to_thread(concurrent.futures.wait, [self._running], 10.0)
        self._thread.close()

    def _deliver(self, outputs: list[RequestOutput], stats: dict | None, failed: dict[str, Exception],
                 events: list[KVEvent] | None = None) -> None:
        self._undelivered.release()
        if stats is not None:
            self.stats = stats
        now = time.monotonic()
        for output in outputs:
            stream = self.streams.get(output.request_id)
            if stream is None:
                continue  # aborted on the loop side already
            stream.push(output, now)
            if output.finished:
                self.streams.pop(output.request_id, None)
        for request_id, error in failed.items():
            stream = self.streams.pop(request_id, None)
            if stream is not None:
                stream.fail(error)
        if events and self.on_kv_events is not None:  # after the outputs: a publisher's error never loses them
            try:
                self.on_kv_events(events)
            except Exception:
                log.exception("KV events not published", num_events=len(events))

    def _fail_all_streams(self, error: Exception) -> None:
        """Loop side, when the engine thread has stopped for good: nobody waits forever."""
        for request_id in list(self.streams):
            self.streams.pop(request_id).fail(error)

    # --- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        log.info("engine thread started")
        try:
            while not self._stop_event.is_set() and self.healthy:
                self._iterate()
        except Exception as exc:  # a bug outside step(): fail every stream, never leave them hanging
            log.exception("engine thread failed")
            self.healthy = False
            self._fail_everything(exc)
        finally:
            if not self.healthy:
                self.loop.call_soon_threadsafe(self._fail_all_streams, RuntimeError("the engine stopped"))
            log.info("engine thread stopped", healthy=self.healthy)

    def _iterate(self) -> None:
        """One turn: apply the inbox, run one step, hand the outputs to the loop."""
        failed: dict[str, Exception] = {}
        block = not self.engine.has_unfinished_requests()
        if not self._drain(block, failed):
            self._stop_event.set()
            return
        outputs: list[RequestOutput] = []
        try:
            if self.engine.has_unfinished_requests():
                outputs = self.engine.step()
        except Exception as exc:  # an engine bug must not hang every client
            log.exception("engine step failed")
            failed.update(self._abort_all(exc))
        self._settle_pins(outputs, failed)
        if outputs or failed or block:
            self._post(outputs, failed)

    def _fail_everything(self, error: Exception) -> None:
        try:
            self._post([], self._abort_all(error))
        except Exception:
            log.exception("could not report the engine failure")

    def _settle_pins(self, outputs: list[RequestOutput], failed: dict[str, Exception]) -> None:
        """Resolve pin futures when their prefill ends (pinned) or fails."""
        if not self._pin_futures:
            return
        for output in outputs:
            if output.finished and output.request_id in self._pin_futures:
                done = self._pin_futures.pop(output.request_id)
                aborted = output.outputs[0].finish_reason == "abort"
                error = RuntimeError("the pin's prefill was stopped") if aborted else None
                self.loop.call_soon_threadsafe(settle, done, output.num_cached_tokens, error)
        for request_id, error in failed.items():
            done = self._pin_futures.pop(request_id, None)
            if done is not None:
                self.loop.call_soon_threadsafe(settle, done, None, error)

    def _drain(self, block: bool, failed: dict[str, Exception]) -> bool:
        """Apply every queued command; wait for one first if the engine is idle. False on stop."""
        try:
            command = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is STOP:
                return False
            if isinstance(command, Add):
                try:
                    self.engine.add(command.request)
                except Exception as exc:
                    failed[command.stream.request_id] = exc
            elif isinstance(command, Abort):
                self.engine.abort_request(command.request_id)
            else:
                self._run_query(command)
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _run_query(self, command: Pin | Unpin | PageMap) -> None:
        try:
            if isinstance(command, Pin):
                request_id = self.engine.pin_prefix(command.pin_id, command.prompt_token_ids, command.cache_salt,
                                                    command.shared_prefix_len)
                self._pin_futures[request_id] = command.done  # settled when the prefill ends
                return
            elif isinstance(command, Unpin):
                result = self.engine.unpin_prefix(command.pin_id)
            else:
                result = self.engine.page_map()
        except Exception as exc:
            self.loop.call_soon_threadsafe(settle, command.done, None, exc)
        else:
            self.loop.call_soon_threadsafe(settle, command.done, result, None)

    def _abort_all(self, error: Exception) -> dict[str, Exception]:
        failed = {}
        for request_id in self.engine.unfinished_request_ids():
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort after engine failure failed", request_id=request_id)
            failed[request_id] = error
        try:
            self.engine.step()  # flush the aborts
        except Exception:
            self.healthy = False  # the thread stops; /ready goes 503; new requests get 503
            log.exception("engine cannot recover")
        return failed

    def _post(self, outputs: list[RequestOutput], failed: dict[str, Exception]) -> None:
        now = time.monotonic()
        stats = None
        if now - self._stats_at > STATS_PERIOD_S or not self.engine.has_unfinished_requests():
            stats, self._stats_at = self.engine.stats(), now
        events = self.engine.take_kv_events() if self.kv_events else None
        while not self._undelivered.acquire(timeout=IDLE_WAIT_S):  # the loop is behind: let it catch up
            if self._stop_event.is_set():
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver, outputs, stats, failed, events)
        except RuntimeError:  # loop closed: shutting down
            self._undelivered.release()
            self._stop_event.set()
