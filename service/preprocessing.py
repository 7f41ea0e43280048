"""A request's work before it can queue, off the event loop: parsing, templates, tokenizing, validating.

A 1 MB body takes ~0.3 s to tokenize. On the event loop that holds every other tenant's
requests, streams and /health for as long; so every handler hands that work to `run`:

    handler (event loop)                      Preprocessing (its own threads)
      authenticate, read the body (413)
      lease: one request + its bytes / 16     tenant's line: at most `per_tenant` running,
        as tokens, one slot (429)      --->     arrival order within it
                                              decode, render the template, tokenize, prepare
      admit, queue, stream             <---   (the tokenizer releases the GIL while it works)

Two pools of `num_threads` threads each (the machine's cores by default). A request whose body
has at least `bulk_bytes` bytes (`request_bytes`, set by service/request_lease.py) is bulk work,
done on threads at nice `bulk_nice` (10 by default): on a small machine a megabyte's tokenizing beside the
engine's OpenMP threads slows every decode step (a thread descheduled at a barrier holds all of
them), so the engine's threads get a busy core first. Small bodies, which take a millisecond,
run at once on the other pool, at normal priority. Why 10 (BENCHMARKS.md section 26): under 16
decoding streams a 103 KB /tokenize took 0.07 s at nice 0, 0.27 s at nice 10, 1.8 s at nice 19,
and up to 8.8 s under SCHED_IDLE, while a flood's effect on another tenant's chats was about the
same from nice 10 on.

A tenant runs at most `per_tenant` calls at once (half the threads, at least one) across both,
so one tenant's large bodies cannot fill them. A caller that goes away stops waiting, but its
tenant's turn ends only when its thread has finished: hanging up does not let a tenant run more.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import TypeVar

import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")

BYTES_PER_TOKEN = 16  # a request's tokens estimated from its body before it is tokenized: few tokens are longer
BULK_BYTES = 64 * 1024  # bodies this large (tokenizing them takes ~20 ms and more) are bulk work
BULK_NICE = 10  # the bulk threads' nice value by default
request_bytes: ContextVar[int] = ContextVar("request_bytes", default=0)  # the body of the request being served


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Preprocessing:
    """Two bounded thread pools, small and bulk work, with a line per tenant (see the module doc)."""

    def __init__(self, num_threads: int = 0, per_tenant: int = 0, bulk_bytes: int = BULK_BYTES,
                 bulk_nice: int = BULK_NICE) -> None:
        self.num_threads = num_threads or default_num_threads()
        self.per_tenant = per_tenant or max(1, self.num_threads // 2)
        if self.per_tenant > self.num_threads:
            raise ValueError(f"per_tenant ({self.per_tenant}) must not exceed num_threads ({self.num_threads})")
        if bulk_bytes < 1:
            raise ValueError(f"bulk_bytes must be >= 1, got {bulk_bytes}")
        self.bulk_bytes = bulk_bytes
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="preprocess")
        self._bulk_pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="preprocess-bulk",
                                             initializer=_yield_to_the_engine, initargs=(bulk_nice,))
        self._lines: dict[str, asyncio.Semaphore] = {}  # tenant -> its turns

    async def run(self, tenant_id: str, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on a pool (bulk if the request's body is), in the tenant's line; its result, or its exception."""
        line = self._lines.get(tenant_id)
        if line is None:
            line = self._lines[tenant_id] = asyncio.Semaphore(self.per_tenant)
        pool = self._bulk_pool if request_bytes.get() >= self.bulk_bytes else self._pool
        await line.acquire()
        try:
            work = asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
        except BaseException:
            line.release()
            raise
        work.add_done_callback(functools.partial(_end_turn, line))
        return await asyncio.shield(work)

    def close(self) -> None:
        """Stop taking work; what runs finishes on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._bulk_pool.shutdown(wait=False, cancel_futures=True)


def _yield_to_the_engine(nice: int) -> None:
    """This thread at `nice` (Linux gives each thread its own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as exc:  # not Linux
        log.warning("bulk preprocessing runs at normal priority", error=str(exc))


def _end_turn(line: asyncio.Semaphore, work: asyncio.Future) -> None:
    """The turn ends when the thread is done, not when its caller stops waiting (whose error nobody reads then)."""
    line.release()
    if not work.cancelled():
        work.exception()


def estimated_tokens(num_bytes: int) -> int:
    """Tokens counted for a body before it is tokenized (corrected once it is)."""
    return num_bytes // BYTES_PER_TOKEN
