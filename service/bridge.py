"""The bridge between the event loop and the engine thread.

The engine thread is the only owner of runtime state. The loop talks to it through a
thread-safe inbox of commands (add, abort); the thread drains the inbox between steps,
runs `engine.step()`, and hands each step's outputs back to the loop once per step with
`loop.call_soon_threadsafe`. On the loop, outputs are fanned out to per-request streams.

    loop                          engine thread
    submit() --add-->  inbox  --> drain -> engine.add_request
    abort()  --abort-> inbox  --> drain -> engine.abort_request
    _deliver(outputs) <-- call_soon_threadsafe -- engine.step()

The engine thread is also where the engine is built (`EngineThread`): torch's OpenMP
runtime (libgomp) keeps a pool of worker threads for every OS thread that runs a parallel
region, so an engine built on one thread and stepped on another leaves two pools, four
threads on a two-core machine. libgomp then stops spinning at its barriers and sleeps and
wakes on a futex at every op. Served, the engine thread was off its CPU 15% of the time and
its OpenMP worker 31%, each sleeping ~2,000 times a second; a decode step of 16 sequences
takes ~1.3x as long built on another thread (bench/bench_contention.py, part 2).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from runtime.chat_template import ChatTemplate
from runtime.grammar import CompiledGrammar, GrammarCompiler
from runtime.kv_events import KVEvent
from runtime.outputs import RequestOutput
from runtime.request import Request
from runtime.request_builder import RequestLimits
from runtime.sampling_params import SamplingParams
from service.streams import RequestStream

log = structlog.get_logger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle engine thread blocks on the inbox before looking again
MAX_UNDELIVERED_STEPS = 2  # the engine thread waits when the loop is this many steps behind
STATS_PERIOD_S = 0.05  # engine stats ride along with a step's outputs at most this often (and when idle)


class Tokenizer(Protocol):
    """What the service asks of the model's tokenizer (runtime.tokenizer)."""

    chat_template: ChatTemplate

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def raw_byte(self, token_id: int) -> int | None: ...
    def token_piece(self, token_id: int) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]: ...


class ModelLike(Protocol):
    """What the event loop may ask of a model: facts fixed at start, and request validation.

    The embedded engine (runtime.Engine) or, behind Dynamo, service.distributed.front_door.RemoteModel.
    """

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    block_size: int
    limits: RequestLimits  # the sizes requests are checked against (max_num_seqs sets admission too)
    grammars: GrammarCompiler  # structured outputs, compiled off the loop (service/grammars.py)

    def tokenize(self, prompt: str | list[int]) -> list[int]: ...
    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                        cache_salt: str | bytes | None = None, shared_prefix_len: int = 0, pin_id: str | None = None,
                        prompt_param: str = "prompt", grammar: CompiledGrammar | None = None,
                        prediction: str | list[int] | None = None, tenant: str = "default",
                        tenant_weight: float = 1.0, priority: int = 0) -> Request: ...


class EngineLike(ModelLike, Protocol):
    """What the service needs from an engine: runtime.Engine, or bench/stub_engine.py's StubEngine.

    The loop may call only the ModelLike part; everything else runs on the engine thread.
    """

    def add(self, request: Request) -> None: ...
    def abort_request(self, request_id: str) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def unfinished_request_ids(self) -> list[str]: ...
    def stats(self) -> dict: ...
    def record_kv_events(self) -> None: ...
    def take_kv_events(self) -> list[KVEvent]: ...
    def pin_prefix(self, pin_id: str, prompt: str | list[int], cache_salt: str | bytes | None = None,
                   shared_prefix_len: int = 0) -> str: ...
    def unpin_prefix(self, pin_id: str) -> bool: ...
    def page_map(self) -> dict: ...


class Bridge(Protocol):
    """What handlers ask of the engine side: EngineBridge (embedded) or, behind Dynamo, DynamoBridge."""

    streams: dict[str, RequestStream]
    stats: dict  # the latest engine stats snapshot (summed over workers behind Dynamo)

    @property
    def healthy(self) -> bool: ...
    @property
    def num_workers(self) -> int: ...
    @property
    def num_inflight(self) -> int: ...
    @property
    def num_inflight_sequences(self) -> int: ...
    def inflight_sequences_by_tenant(self) -> Counter[str]: ...
    def start(self) -> None: ...
    def submit(self, stream: RequestStream, request: Request) -> None: ...
    def abort(self, request_id: str) -> None: ...
    async def pin(self, pin_id: str, prompt_token_ids: list[int], cache_salt: bytes | None,
                  shared_prefix_len: int = 0) -> int: ...
    async def unpin(self, pin_id: str) -> bool: ...
    async def page_map(self) -> dict: ...
    async def stop(self) -> None: ...


@dataclass
class _Add:
    stream: RequestStream
    request: Request  # validated by engine.prepare_request on the loop


@dataclass
class _Pin:
    pin_id: str
    prompt_token_ids: list[int]
    cache_salt: bytes | None
    shared_prefix_len: int
    done: asyncio.Future


@dataclass
class _Unpin:
    pin_id: str
    done: asyncio.Future


@dataclass
class _PageMap:
    done: asyncio.Future


@dataclass
class _Abort:
    request_id: str


_STOP = object()


class EngineThread:
    """The one daemon thread that builds the engine and then runs it (see the module docstring).

    Jobs run in the order submitted; `EngineBridge` submits its loop as the last one.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (callable, args, concurrent future) or None
        self._thread = threading.Thread(target=self._work, name="engine", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the engine thread; its result or exception comes back in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        return future

    async def call(self, fn: Callable, *args):
        """Await fn(*args) run on the engine thread."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        """The thread ends after the jobs already submitted."""
        self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)


class StreamsInFlight:
    """A bridge's loop-side table of live streams (request id -> stream), and what admission counts in it."""

    streams: dict[str, RequestStream]

    @property
    def num_inflight(self) -> int:
        return len(self.streams)

    @property
    def num_inflight_sequences(self) -> int:
        return sum(stream.n for stream in self.streams.values())

    def inflight_sequences_by_tenant(self) -> Counter[str]:
        """Sequences in flight per tenant."""
        counts: Counter[str] = Counter()
        for stream in self.streams.values():
            counts[stream.tenant] += stream.n
        return counts


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
        """Register the stream and send its request (from engine.prepare_request) to the engine; returns at once."""
        self.streams[stream.request_id] = stream
        self.inbox.put(_Add(stream, request))

    async def pin(self, pin_id: str, prompt_token_ids: list[int], cache_salt: bytes | None,
                  shared_prefix_len: int = 0) -> int:
        """Prefill a prefix and hold its pages (engine.pin_prefix); once they are pinned, the prefill's cached
        tokens (the rest were computed: its tenant's bill).

        Raises what the engine raised (e.g. the pin budget) or RuntimeError if the prefill was stopped.
        """
        done = self.loop.create_future()
        self.inbox.put(_Pin(pin_id, prompt_token_ids, cache_salt, shared_prefix_len, done))
        return await done

    async def unpin(self, pin_id: str) -> bool:
        done = self.loop.create_future()
        self.inbox.put(_Unpin(pin_id, done))
        return await done

    async def page_map(self) -> dict:
        """engine.page_map(), taken on the engine thread between steps."""
        done = self.loop.create_future()
        self.inbox.put(_PageMap(done))
        return await done

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages are free by the end of the engine's next step."""
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self.inbox.put(_Abort(request_id))
            stream.close("abort")

    @property
    def num_workers(self) -> int:
        return 1

    async def stop(self) -> None:
        """Abort everything still running and join the engine thread."""
        for request_id in list(self.streams):
            self.abort(request_id)
        self._stop_event.set()
        self.inbox.put(_STOP)
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
                self.loop.call_soon_threadsafe(_settle, done, output.num_cached_tokens, error)
        for request_id, error in failed.items():
            done = self._pin_futures.pop(request_id, None)
            if done is not None:
                self.loop.call_soon_threadsafe(_settle, done, None, error)

    def _drain(self, block: bool, failed: dict[str, Exception]) -> bool:
        """Apply every queued command; wait for one first if the engine is idle. False on stop."""
        try:
            command = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                try:
                    self.engine.add(command.request)
                except Exception as exc:
                    failed[command.stream.request_id] = exc
            elif isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
            else:
                self._run_query(command)
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _run_query(self, command: _Pin | _Unpin | _PageMap) -> None:
        try:
            if isinstance(command, _Pin):
                request_id = self.engine.pin_prefix(command.pin_id, command.prompt_token_ids, command.cache_salt,
                                                    command.shared_prefix_len)
                self._pin_futures[request_id] = command.done  # settled when the prefill ends
                return
            elif isinstance(command, _Unpin):
                result = self.engine.unpin_prefix(command.pin_id)
            else:
                result = self.engine.page_map()
        except Exception as exc:
            self.loop.call_soon_threadsafe(_settle, command.done, None, exc)
        else:
            self.loop.call_soon_threadsafe(_settle, command.done, result, None)

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


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
