"""service/journal.py: appends never wait, nothing is lost or counted twice across outages and restarts."""

import asyncio
import time

import msgspec
import pytest
import redis.exceptions
from structlog.testing import capture_logs

from service.billing.journal import UsageJournal
from service.billing.ledger import RedisLedger, SQLiteLedger
from service.redis_pool import create_redis
from service.billing.usage import UsageRecord, UsageTotals
from tests.service.redis_fixture import own_redis_server  # noqa: F401

FAST = dict(flush_interval_s=0.01, retry_backoff_s=0.005, max_backoff_s=0.05)


def usage(i: int, tenant="acme") -> UsageRecord:
    return UsageRecord(f"req-{i}", tenant, "stories", 100 + i, i % 50, 7, "stop", 1_700_000_000.0 + i,
                       1_700_000_001.5 + i)


def expected_totals(indices) -> UsageTotals:
    totals = UsageTotals()
    for i in indices:
        totals.add(usage(i), 1000 + i)
    return totals


class FlakyLedger:
    """Wraps a ledger; the first `num_failures` batches raise ConnectionError (or wait forever if hang)."""

    def __init__(self, ledger, num_failures: int = 10**9, hang: bool = False) -> None:
        self.ledger = ledger
        self.num_failures = num_failures
        self.hang = hang
        self.num_calls = 0

    async def record_many(self, items):
        self.num_calls += 1
        if self.hang:
            await asyncio.Event().wait()
        if self.num_calls <= self.num_failures:
            raise redis.exceptions.ConnectionError("Connection refused")
        return await self.ledger.record_many(items)


def journal_lines(path) -> list[bytes]:
    return path.read_bytes().splitlines()


def test_appended_records_reach_the_ledger_and_the_checkpoint(tmp_path):
    async def main():
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        journal = UsageJournal(tmp_path / "usage.jsonl", ledger, **FAST)
        await journal.start()
        for i in range(10):
            journal.append(usage(i), 1000 + i)
        await journal.wait_applied(timeout=5)
        pending = journal.num_pending
        left = await journal.stop()
        totals = await ledger.totals("acme")
        await ledger.close()
        return pending, left, totals

    pending, left, totals = asyncio.run(main())
    assert (pending, left, totals) == (0, 0, expected_totals(range(10)))
    lines = journal_lines(tmp_path / "usage.jsonl")
    assert len(lines) == 11 and b'"journal":"pagedserve-usage"' in lines[0]
    assert msgspec.json.decode(lines[1]) == {"record": msgspec.to_builtins(usage(0)), "cost_pico_usd": 1000}
    checkpoint = msgspec.json.decode((tmp_path / "usage.jsonl.checkpoint").read_bytes())
    assert checkpoint["offset"] == (tmp_path / "usage.jsonl").stat().st_size


def test_append_returns_at_once_while_the_ledger_hangs(tmp_path):
    async def main():
        sqlite = SQLiteLedger(tmp_path / "ledger.db")
        journal = UsageJournal(tmp_path / "usage.jsonl", FlakyLedger(sqlite, hang=True), **FAST)
        await journal.start()
        began = time.perf_counter()
        for i in range(2000):
            journal.append(usage(i), 1000 + i)
        append_s = time.perf_counter() - began
        await asyncio.sleep(0.1)
        on_disk = len(journal_lines(tmp_path / "usage.jsonl")) - 1
        pending = journal.num_pending
        left = await journal.stop(timeout=0.2)
        await sqlite.close()
        return append_s, on_disk, pending, left

    append_s, on_disk, pending, left = asyncio.run(main())
    assert append_s < 0.5
    assert (on_disk, pending, left) == (2000, 2000, 2000)


def test_restart_replays_unapplied_records_without_double_counting(tmp_path):
    path = tmp_path / "usage.jsonl"

    async def main():
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        down = UsageJournal(path, FlakyLedger(ledger), **FAST)  # the ledger never answers
        await down.start()
        for i in range(20):
            down.append(usage(i), 1000 + i)
        left_after_outage = await down.stop(timeout=0.3)
        # 5 of them reached the ledger before the crash, but no checkpoint says so
        await ledger.record_many([(usage(i), 1000 + i) for i in range(5)])

        replayed = []
        for _ in range(2):  # the second start finds nothing to replay
            journal = UsageJournal(path, ledger, **FAST)
            await journal.start()
            replayed.append(journal.num_pending)
            await journal.wait_applied(timeout=5)
            await journal.stop()
        (tmp_path / "usage.jsonl.checkpoint").unlink()  # a lost checkpoint replays everything: deduped
        journal = UsageJournal(path, ledger, **FAST)
        await journal.start()
        replayed.append(journal.num_pending)
        await journal.wait_applied(timeout=5)
        await journal.stop()
        totals = await ledger.totals("acme")
        await ledger.close()
        return left_after_outage, replayed, totals

    left_after_outage, replayed, totals = asyncio.run(main())
    assert left_after_outage == 20
    assert replayed == [20, 0, 20]
    assert totals == expected_totals(range(20))


TORN = b'{"record":{"request_id":"req-9","ten'


def test_a_torn_last_line_is_cut_at_start(tmp_path):
    path = tmp_path / "usage.jsonl"

    async def main():
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        first = UsageJournal(path, FlakyLedger(ledger), **FAST)
        await first.start()
        for i in range(3):
            first.append(usage(i), 1000 + i)
        await first.stop(timeout=0.1)
        with open(path, "ab") as f:
            f.write(TORN)  # a crash in the middle of a write
        journal = UsageJournal(path, ledger, **FAST)
        with capture_logs() as logs:
            await journal.start()
        pending = journal.num_pending
        await journal.wait_applied(timeout=5)
        journal.append(usage(3), 1003)
        await journal.wait_applied(timeout=5)
        await journal.stop()
        totals = await ledger.totals("acme")
        await ledger.close()
        return logs, pending, totals

    logs, pending, totals = asyncio.run(main())
    assert [(e["event"], e["num_bytes"]) for e in logs if e["log_level"] == "warning"] == [
        ("usage journal ends in a torn line; cutting it", len(TORN))]
    assert pending == 3
    assert totals == expected_totals(range(4))
    assert len(journal_lines(path)) == 5


def test_ledger_outage_warns_once_then_reports_recovery(tmp_path):
    async def main():
        sqlite = SQLiteLedger(tmp_path / "ledger.db")
        flaky = FlakyLedger(sqlite, num_failures=25)
        journal = UsageJournal(tmp_path / "usage.jsonl", flaky, flush_interval_s=0.01, retry_backoff_s=0.001,
                               max_backoff_s=0.002)
        with capture_logs() as logs:
            await journal.start()
            for i in range(5):
                journal.append(usage(i), 1000 + i)
            await journal.wait_applied(timeout=5)
            await journal.stop()
        totals = await sqlite.totals("acme")
        await sqlite.close()
        return logs, flaky.num_calls, totals

    logs, num_calls, totals = asyncio.run(main())
    assert [(e["log_level"], e["event"]) for e in logs] == [
        ("warning", "usage ledger unreachable; records stay in the journal"),
        ("info", "usage ledger reachable again"),
    ]
    assert logs[1]["num_failures"] == 25 and num_calls == 26
    assert totals == expected_totals(range(5))


def test_compaction_keeps_only_the_unapplied_tail(tmp_path):
    path = tmp_path / "usage.jsonl"

    async def main():
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        journal = UsageJournal(path, ledger, compact_bytes=4000, **FAST)
        await journal.start()
        header = journal_lines(path)[0]
        for i in range(100):
            journal.append(usage(i), 1000 + i)
            if i % 10 == 9:
                await journal.wait_applied(timeout=5)
        await journal.stop()
        size = path.stat().st_size
        restarted = UsageJournal(path, ledger, **FAST)
        await restarted.start()
        pending = restarted.num_pending
        await restarted.stop()
        totals = await ledger.totals("acme")
        await ledger.close()
        return header, size, pending, totals

    header, size, pending, totals = asyncio.run(main())
    assert journal_lines(path)[0] != header  # a new file_id
    assert size < 4000 + 10 * 300
    assert pending == 0
    assert totals == expected_totals(range(100))


def test_second_journal_on_the_same_file_is_refused(tmp_path):
    async def main():
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        first = UsageJournal(tmp_path / "usage.jsonl", ledger, **FAST)
        await first.start()
        with pytest.raises(RuntimeError, match="in use by another journal"):
            await UsageJournal(tmp_path / "usage.jsonl", ledger, **FAST).start()
        await first.stop()
        await ledger.close()

    asyncio.run(main())


def test_redis_kill_9_mid_load_then_restart_loses_and_doubles_nothing(own_redis_server, tmp_path):  # noqa: F811
    num_records = 900

    async def load(journal) -> int:
        """Append steadily; SIGKILL Redis at 300, start it again (same port and dir, AOF) at 600."""
        pending_during_outage = 0
        for i in range(num_records):
            journal.append(usage(i), 1000 + i)
            if i % 10 == 9:
                await asyncio.sleep(0.004)
            if i == 300:
                own_redis_server.kill()
            if i == 600:
                pending_during_outage = journal.num_pending
                await asyncio.to_thread(own_redis_server.start)
        return pending_during_outage

    async def main():
        client = create_redis(own_redis_server.url)
        ledger = RedisLedger(client, "bill:")
        journal = UsageJournal(tmp_path / "usage.jsonl", ledger, flush_interval_s=0.01, retry_backoff_s=0.01,
                               max_backoff_s=0.1)
        await journal.start()
        with capture_logs() as logs:
            pending_during_outage = await load(journal)
            await journal.wait_applied(timeout=30)
        left = await journal.stop()
        totals = await ledger.totals("acme")
        await client.aclose()
        return logs, pending_during_outage, left, totals

    logs, pending_during_outage, left, totals = asyncio.run(main())
    assert [e["event"] for e in logs if e["log_level"] in ("warning", "info")] == [
        "usage ledger unreachable; records stay in the journal", "usage ledger reachable again"]
    assert pending_during_outage >= 290
    assert left == 0
    assert totals == expected_totals(range(num_records))


def test_redis_crash_after_applying_a_batch_before_the_reply_counts_it_once(
        own_redis_server, tmp_path):  # noqa: F811
    class CrashAfterApply:
        """The third batch reaches Redis, then Redis dies before the journal hears back."""

        def __init__(self, ledger):
            self.ledger = ledger
            self.num_calls = 0

        async def record_many(self, items):
            self.num_calls += 1
            applied = await self.ledger.record_many(items)
            if self.num_calls == 3:
                own_redis_server.kill()
                await asyncio.to_thread(own_redis_server.start)
                raise redis.exceptions.ConnectionError("Connection reset by peer")
            return applied

    async def main():
        client = create_redis(own_redis_server.url)
        ledger = RedisLedger(client, "bill:")
        wrapper = CrashAfterApply(ledger)
        journal = UsageJournal(tmp_path / "usage.jsonl", wrapper, **FAST)
        await journal.start()
        for i in range(40):
            journal.append(usage(i), 1000 + i)
            if i % 10 == 9:
                await journal.wait_applied(timeout=10)
        await journal.stop()
        totals = await ledger.totals("acme")
        await client.aclose()
        return wrapper.num_calls, totals

    num_calls, totals = asyncio.run(main())
    assert num_calls == 5  # batch 3 sent twice
    assert totals == expected_totals(range(40))


def test_append_futures_are_done_once_the_record_is_on_disk(tmp_path):
    async def main():
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        journal = UsageJournal(tmp_path / "usage.jsonl", ledger, retry_backoff_s=0.005)
        await journal.start()
        futures = [journal.append(usage(i), 1000 + i) for i in range(5)]
        await asyncio.wait_for(asyncio.gather(*futures), 5)
        on_disk = [msgspec.json.decode(line)["record"]["request_id"] for line in journal_lines(journal.path)[1:]]
        await journal.stop()
        await ledger.close()
        return on_disk

    assert asyncio.run(main()) == [f"req-{i}" for i in range(5)]


def test_a_disk_that_keeps_failing_fails_the_futures_at_stop_and_nothing_hangs(tmp_path):
    async def main():
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        journal = UsageJournal(tmp_path / "usage.jsonl", ledger, retry_backoff_s=0.01, max_backoff_s=0.02,
                               stop_timeout_s=0.2)
        await journal.start()

        def broken_write(data: bytes) -> None:
            raise OSError(5, "Input/output error")

        journal._file.write = broken_write
        future = journal.append(usage(1), 1001)
        await asyncio.sleep(0.1)
        not_yet = future.done()
        started = time.monotonic()
        pending = await journal.stop()
        stopped_in = time.monotonic() - started
        await ledger.close()
        return not_yet, future, pending, stopped_in, journal._writer.is_alive()

    not_yet, future, pending, stopped_in, writer_alive = asyncio.run(main())
    assert not not_yet and pending == 1
    assert isinstance(future.exception(), RuntimeError) and "stopped before writing" in str(future.exception())
    assert stopped_in < 3 and not writer_alive


@pytest.mark.parametrize("num_records", [0, 5])
def test_stop_ends_when_the_journal_is_written_and_applied_not_at_its_timeout(tmp_path, num_records):
    """A clean stop used to leave the applier waiting for a wake-up that never came, so every server's
    shutdown waited out stop_timeout_s (5 s) with nothing left to do."""
    async def main():
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        journal = UsageJournal(tmp_path / "usage.jsonl", ledger, stop_timeout_s=60.0)
        await journal.start()
        for i in range(num_records):
            journal.append(usage(i), 1000 + i)
        started = time.monotonic()
        left = await journal.stop()
        stopped_after = time.monotonic() - started
        totals = await ledger.totals("acme")
        await ledger.close()
        return left, stopped_after, totals

    left, stopped_after, totals = asyncio.run(main())
    assert left == 0 and totals.requests == num_records
    assert stopped_after < 10.0  # well short of the 60 s timeout: it ended, nothing timed out
