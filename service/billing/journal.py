"""A write-ahead journal in front of the ledger: no usage is lost while Redis is down or slow.

    append() ──> memory buffer ──(writer: group commit)──> file + fdatasync ──> append's future done
                                                              │
    ledger <──(applier: record_many, retried with backoff until accepted)
                       └──> checkpoint: the file offset applied so far

The file format, checkpoint and compaction are in service/billing/journal_file.py.

- `append` is synchronous and never waits for the disk or the ledger; it returns a future that
  is done once the record is on disk (fdatasync'd). The service sends a request's last message
  only after that, so an answer a client received is never lost, not even on kill -9.
- Group commit: the writer (its own thread, woken by `append` without a trip through the
  event loop) takes everything buffered, writes it and fdatasyncs once, then hands the
  batch's futures back to the loop in one callback; records appended meanwhile form the next
  batch. So a batch is one fsync's worth of arrivals, with no timer on the path;
  `flush_interval_s` > 0 adds a wait (up to `batch_records` records), for disks where each
  fsync is dear. `batch_records` also caps what the applier hands the ledger at once.
- `start` replays everything after the checkpoint. Replays are safe because the ledger counts a
  request id once (Redis remembers ids for 30 days; SQLite forever).
- Any ledger error is retried, with backoff up to `max_backoff_s`: the first failure logs an
  'unreachable' warning, then at most one 'still unreachable' per `warn_interval_s`, and one
  'reachable again' at the end. A batch the ledger keeps refusing holds the journal back,
  loudly, but is never dropped.
- The applied prefix of the file is compacted away once it passes `compact_bytes`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import structlog

from service.billing.journal_file import JournalEntry, JournalFile, encode
from service.billing.ledger import Ledger, check_entry
from service.billing.usage import UsageRecord

log = structlog.get_logger(__name__)


class UsageJournal:
    """Durable, asynchronous delivery of usage records to a ledger (see the module doc)."""

    def __init__(self, path: str | Path, ledger: Ledger, *, flush_interval_s: float = 0.0,
                 batch_records: int = 256, retry_backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 warn_interval_s: float = 30.0, compact_bytes: int = 64 << 20, stop_timeout_s: float = 5.0) -> None:
        self.path = Path(path)
        self._file = JournalFile(path)
        self._ledger = ledger
        self._flush_interval_s = flush_interval_s
        self._batch_records = batch_records
        self._retry_backoff_s = retry_backoff_s
        self._max_backoff_s = max_backoff_s
        self._warn_interval_s = warn_interval_s
        self._compact_bytes = compact_bytes
        self._stop_timeout_s = stop_timeout_s
        self._lock = threading.Condition()  # guards the buffer below; the writer thread waits on it
        self._buffer = bytearray()  # encoded lines not yet written
        self._waiters: list[asyncio.Future] = []  # one per buffered record (so its count): done once on disk
        self._file_lock = threading.Lock()  # a write and a compaction never overlap
        self._abandoned = False  # stop() timed out: the writer gives up retrying
        self._writer: threading.Thread | None = None
        self._writer_done: asyncio.Future | None = None  # resolved on the loop when the writer thread returns
        self._writer_error: BaseException | None = None  # the writer thread died: append refuses
        self._num_appended = 0  # sequence counters for this object's life, replayed records included
        self._num_applied = 0
        self._running = False
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self._outage_since: float | None = None
        self._last_warning = 0.0
        self._num_failures = 0

    @property
    def num_pending(self) -> int:
        """Records appended (or found at start) that the ledger has not accepted yet."""
        return self._num_appended - self._num_applied

    def append(self, record: UsageRecord, cost_pico_usd: int) -> asyncio.Future:
        """Queue one record; returns at once (no disk, no ledger) a future done once it is on disk.

        Raises ValueError for an invalid record, RuntimeError when the journal is not running.
        """
        if not self._running or self._stopping or self._writer_error is not None:
            raise RuntimeError(f"the usage journal {self.path} is not running")
        check_entry(record, cost_pico_usd)
        durable = self._loop.create_future()
        line = encode(JournalEntry(record, cost_pico_usd)) + b"\n"
        with self._lock:
            self._buffer += line
            self._waiters.append(durable)
            self._lock.notify()
        self._num_appended += 1
        return durable

    async def start(self) -> None:
        """Open (or create) the file, queue what the checkpoint says is unapplied, start the tasks."""
        if self._running:
            raise RuntimeError(f"the usage journal {self.path} is already running")
        self._loop = asyncio.get_running_loop()
        self._durable_changed = asyncio.Event()
        self._progress = asyncio.Event()
        num_replayed = await asyncio.to_thread(self._file.open)
        with self._lock:
            self._buffer.clear()
            self._waiters = []
        self._num_appended = self._num_applied + num_replayed
        self._running, self._stopping, self._abandoned = True, False, False
        if num_replayed:
            log.info("replaying usage journal", path=str(self.path), num_records=num_replayed)
        writer_done = self._writer_done = self._loop.create_future()
        self._writer_error = None
        self._writer = threading.Thread(target=self._write_thread, args=(writer_done,), name="usage-journal-writer",
                                        daemon=True)
        self._writer.start()
        self._tasks = [asyncio.create_task(_wait_for(writer_done), name="usage-journal-writer"),
                       asyncio.create_task(self._apply_loop(), name="usage-journal-applier")]
        for task in self._tasks:
            task.add_done_callback(self._log_crash)

    async def stop(self, timeout: float | None = None) -> int:
        """Write what is buffered, apply what the ledger takes within `timeout`; returns records left pending."""
        if not self._running:
            return self.num_pending
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._durable_changed.set()
        _, not_done = await asyncio.wait(self._tasks, timeout=self._stop_timeout_s if timeout is None else timeout)
        with self._lock:
            self._abandoned = True  # a writer still retrying a failing disk gives up now
            self._lock.notify()
        for task in not_done:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self._writer.join, 10.0)
        self._running = False
        with self._lock:
            self._fail_waiters(RuntimeError(f"the usage journal {self.path} stopped before writing the record"))
        if self._writer.is_alive():  # stuck in a write that never returns: leave the file to it
            log.error("usage journal writer did not stop; its file stays open", path=str(self.path))
        else:
            await asyncio.to_thread(self._file.close)
        if self._waiters:
            log.error("usage journal stopped with records not written", path=str(self.path),
                      num_records=len(self._waiters))
        elif self.num_pending:
            log.warning("usage journal stopped with records not applied; they replay at next start",
                        path=str(self.path), num_records=self.num_pending)
        return self.num_pending

    async def wait_applied(self, timeout: float) -> None:
        """Wait until every record appended before this call is in the ledger; TimeoutError otherwise."""
        target = self._num_appended
        try:
            async with asyncio.timeout(timeout):
                while self._num_applied < target:
                    await self._progress.wait()
        except TimeoutError:
            raise TimeoutError(f"usage journal: {target - self._num_applied} records not applied "
                               f"after {timeout} s") from None

    def _log_crash(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            log.error("usage journal task failed; records stay in the journal until a restart",
                      path=str(self.path), task=task.get_name(), error=f"{type(error).__name__}: {error}")

    def _write_thread(self, done: asyncio.Future) -> None:
        """The writer thread: write until stopped, then tell the loop (`done`) how it ended."""
        error = None
        try:
            self._write_until_stopped()
        except BaseException as exc:
            error = exc
            raise
        finally:  # a return from the loop too (it used to skip an else clause: stop() then waited out its timeout)
            self._on_loop(self._writer_ended, done, error)

    def _write_until_stopped(self) -> None:
        """Take every buffered line, write + fdatasync, resolve their futures; until stopped."""
        backoff = self._retry_backoff_s
        while True:
            with self._lock:
                while not self._buffer and not self._stopping:
                    self._lock.wait()
                if self._flush_interval_s > 0 and not self._stopping:
                    self._lock.wait_for(lambda: len(self._waiters) >= self._batch_records or self._stopping,
                                        self._flush_interval_s)
                if not self._buffer:
                    return  # stopping, and everything is written
                data, waiters = bytes(self._buffer), self._waiters
                self._buffer.clear()
                self._waiters = []
            try:
                with self._file_lock:
                    self._file.write(data)
            except OSError as error:
                log.error("cannot write the usage journal; retrying", path=str(self.path), error=str(error))
                with self._lock:
                    self._buffer[0:0] = data
                    self._waiters[0:0] = waiters
                    if not self._abandoned:
                        self._lock.wait(backoff)  # stop() wakes it
                    if self._abandoned:
                        return
                backoff = min(backoff * 2, self._max_backoff_s)
                continue
            backoff = self._retry_backoff_s
            self._on_loop(self._written, waiters)

    def _on_loop(self, fn, *args) -> None:
        """From the writer thread: run fn(*args) on the loop, unless the loop is gone (shut down)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def _writer_ended(self, done: asyncio.Future, error: BaseException | None) -> None:
        """On the loop: the writer thread returned (stopped) or raised; the applier may finish.

        A writer that raised leaves the journal refusing appends (a 503 at once for the
        requests, rather than each waiting out its timeout) and fails what it held.
        """
        if error is not None:
            self._writer_error = error
            with self._lock:
                self._fail_waiters(RuntimeError(f"the usage journal {self.path} writer failed: {error!r}"))
        if not done.done():
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(None)
        self._durable_changed.set()

    def _fail_waiters(self, error: Exception) -> None:
        """Fail every buffered record's future (call with the lock held)."""
        for durable in self._waiters:
            if not durable.done():
                durable.set_exception(error)

    def _written(self, waiters: list[asyncio.Future]) -> None:
        """On the loop: a batch is on disk."""
        for durable in waiters:
            if not durable.done():
                durable.set_result(None)
        self._durable_changed.set()

    async def _apply_loop(self) -> None:
        file = self._file
        while True:
            if file.applied_end >= file.durable_end:
                # the writer's future, not its task: the task is done a loop turn after the future, and the
                # wake-up that _writer_ended sends could come before it (the applier then slept to stop's timeout)
                if self._stopping and self._writer_done.done():
                    return
                self._durable_changed.clear()
                await self._durable_changed.wait()
                continue
            entries, num_lines, end = await asyncio.to_thread(file.read_batch, self._batch_records)
            await self._apply(entries)
            self._num_applied += num_lines
            self._progress.set()
            self._progress = asyncio.Event()
            await asyncio.to_thread(file.mark_applied, end)
            if file.applied_end - file.header_end >= self._compact_bytes:
                await asyncio.to_thread(self._compact)
                log.info("compacted the usage journal", path=str(self.path), num_pending=self.num_pending)

    def _compact(self) -> None:
        with self._file_lock:
            self._file.compact()

    async def _apply(self, entries: list[JournalEntry]) -> None:
        """record_many until the ledger takes the batch, with backoff and rate-limited warnings."""
        backoff = self._retry_backoff_s
        items = [(entry.record, entry.cost_pico_usd) for entry in entries]
        while True:
            try:
                await self._ledger.record_many(items)
                break
            except Exception as error:  # noqa: BLE001 - every ledger error is retried; the data stays on disk
                self._note_failure(error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)
        if self._outage_since is not None:
            log.info("usage ledger reachable again", path=str(self.path), num_failures=self._num_failures,
                     outage_s=round(time.monotonic() - self._outage_since, 3))
            self._outage_since = None

    def _note_failure(self, error: Exception) -> None:
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since, self._num_failures, self._last_warning = now, 0, now
            log.warning("usage ledger unreachable; records stay in the journal", path=str(self.path),
                        error=f"{type(error).__name__}: {error}", num_pending=self.num_pending)
        elif now - self._last_warning >= self._warn_interval_s:
            self._last_warning = now
            log.warning("usage ledger still unreachable", path=str(self.path),
                        error=f"{type(error).__name__}: {error}", num_failures=self._num_failures,
                        outage_s=round(now - self._outage_since, 3), num_pending=self.num_pending)
        self._num_failures += 1


async def _wait_for(future: asyncio.Future) -> None:
    await future
