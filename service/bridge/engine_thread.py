"""The one daemon thread that builds the engine and then runs it.

The engine is built on the thread that will step it: torch's OpenMP
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
from collections.abc import Callable


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
