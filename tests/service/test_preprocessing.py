"""service/preprocessing.py: a bounded pool where one tenant's work cannot fill every thread."""

import asyncio
import threading

import pytest

from service.preprocessing import BULK_NICE, Preprocessing, estimated_tokens, request_bytes


class Gate:
    """Work that blocks its thread until opened, and says how many run at once."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most_running = 0

    def work(self, value):
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if not self.opened.wait(10):
                raise TimeoutError("the gate was never opened")
            return value
        finally:
            with self.lock:
                self.running -= 1


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_one_tenant_runs_at_most_its_share_and_another_tenant_gets_a_thread():
    async def main():
        pool = Preprocessing(num_threads=2, per_tenant=1)
        gate = Gate()
        try:
            flood = [asyncio.ensure_future(pool.run("b", gate.work, i)) for i in range(4)]
            await _until(lambda: gate.running == 1)
            other = await asyncio.wait_for(pool.run("a", lambda: "a's"), 10)  # while b's line waits
            running_then = gate.running
            gate.opened.set()
            return other, running_then, gate.most_running, await asyncio.gather(*flood)
        finally:
            pool.close()

    other, running_then, most_running, flood = asyncio.run(main())
    assert other == "a's"
    assert (running_then, most_running) == (1, 1)
    assert flood == [0, 1, 2, 3]  # in arrival order, each its own result


def test_a_caller_that_leaves_keeps_its_turn_until_its_thread_is_done():
    async def main():
        pool = Preprocessing(num_threads=2, per_tenant=1)
        gate = Gate()
        try:
            first = asyncio.ensure_future(pool.run("b", gate.work, 1))
            await _until(lambda: gate.running == 1)
            first.cancel()
            second = asyncio.ensure_future(pool.run("b", gate.work, 2))
            await asyncio.sleep(0.2)
            running_before_open = gate.running  # the cancelled work still runs; the second waits its turn
            gate.opened.set()
            return running_before_open, await asyncio.wait_for(second, 10), gate.most_running
        finally:
            pool.close()

    assert asyncio.run(main()) == (1, 2, 1)


def test_the_works_exception_reaches_its_caller_and_frees_the_turn():
    def fail():
        raise ValueError("bad body")

    async def main():
        pool = Preprocessing(num_threads=1, per_tenant=1)
        try:
            with pytest.raises(ValueError, match="bad body"):
                await pool.run("b", fail)
            return await asyncio.wait_for(pool.run("b", lambda: "next"), 10)
        finally:
            pool.close()

    assert asyncio.run(main()) == "next"


def test_sizes_default_to_the_machine_and_a_share_cannot_exceed_the_pool():
    pool = Preprocessing()
    try:
        assert pool.num_threads >= 1 and 1 <= pool.per_tenant <= pool.num_threads
    finally:
        pool.close()
    with pytest.raises(ValueError, match="per_tenant"):
        Preprocessing(num_threads=2, per_tenant=3)


def test_a_body_is_charged_a_token_per_sixteen_bytes_before_it_is_read():
    assert (estimated_tokens(0), estimated_tokens(15), estimated_tokens(1 << 20)) == (0, 0, 65536)


def test_a_large_body_is_bulk_work_on_threads_that_yield_to_the_engine():
    import os

    def where() -> tuple[str, int, int]:
        thread = threading.get_native_id()
        return (threading.current_thread().name, os.sched_getscheduler(thread),
                os.getpriority(os.PRIO_PROCESS, thread))

    async def main():
        pool = Preprocessing(num_threads=1, per_tenant=1, bulk_bytes=1000)
        try:
            small = await pool.run("b", where)
            request_bytes.set(1000)  # as RequestLease sets it for a request's whole handling
            bulk = await pool.run("b", where)
            return small, bulk
        finally:
            pool.close()

    (small_thread, _, small_nice), (bulk_thread, _, bulk_nice) = asyncio.run(main())
    assert small_thread.startswith("preprocess_") and small_nice == os.getpriority(os.PRIO_PROCESS, 0)
    assert bulk_thread.startswith("preprocess-bulk") and bulk_nice == BULK_NICE
