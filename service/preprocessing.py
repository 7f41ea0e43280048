"""A request's work before it can queue, off the event loop: parsing, templates, tokenizing, validating.

A 1 MB body takes ~0.3 s to tokenize. On the event loop that holds every other tenant's
requests, streams and /health for as long; so every handler hands that work to `run`:

    handler (event loop)                      Preprocessing (its own threads)
      authenticate, read the body (413)
      lease: one request + its bytes / 16     tenant's line: at most `per_tenant` running,
        as tokens, one slot (429)      --->     arrival order within it
                                              decode, render the template, tokenize, prepare
      admit, queue, stream             <---   (the tokenizer releases the GIL while it works)

The pool has `num_threads` threads (the machine's cores by default); a tenant gets at most
`per_tenant` of them at once (half, at least one), so one tenant's large bodies cannot fill it. A
caller that goes away stops waiting, but its tenant's turn ends only when its thread has finished:
hanging up does not let a tenant run more at once.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

BYTES_PER_TOKEN = 16  # a request's tokens estimated from its body before it is tokenized: few tokens are longer


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Preprocessing:
    """A bounded thread pool with a line per tenant (see the module doc)."""

    def __init__(self, num_threads: int = 0, per_tenant: int = 0, nice: int = 0) -> None:
        self.num_threads = num_threads or default_num_threads()
        self.per_tenant = per_tenant or max(1, self.num_threads // 2)
        if self.per_tenant > self.num_threads:
            raise ValueError(f"per_tenant ({self.per_tenant}) must not exceed num_threads ({self.num_threads})")
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="preprocess", initializer=_lower_priority,
                                        initargs=(nice,))
        self._lines: dict[str, asyncio.Semaphore] = {}  # tenant -> its turns

    async def run(self, tenant_id: str, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the pool, in the tenant's line; its result, or its exception."""
        line = self._lines.get(tenant_id)
        if line is None:
            line = self._lines[tenant_id] = asyncio.Semaphore(self.per_tenant)
        await line.acquire()
        try:
            work = asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
        except BaseException:
            line.release()
            raise
        work.add_done_callback(functools.partial(_end_turn, line))
        return await asyncio.shield(work)

    def close(self) -> None:
        """Stop taking work; what runs finishes on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority(nice: int) -> None:
    """This thread yields a busy core to the engine's: Linux schedules threads, each with its own nice value."""
    if nice and hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def _end_turn(line: asyncio.Semaphore, work: asyncio.Future) -> None:
    """The turn ends when the thread is done, not when its caller stops waiting (whose error nobody reads then)."""
    line.release()
    if not work.cancelled():
        work.exception()


def estimated_tokens(num_bytes: int) -> int:
    """Tokens counted for a body before it is tokenized (corrected once it is)."""
    return num_bytes // BYTES_PER_TOKEN
