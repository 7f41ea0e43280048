"""service/billing/ledger.py on SQLite and on a real redis-server: exact sums, each request id once."""

import asyncio
import tempfile
import uuid
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.billing.ledger import RedisLedger, SQLiteLedger
from service.redis_pool import create_redis
from service.billing.usage import PricePlan, UsageRecord, UsageTotals, cost_pico_usd, format_usd
from tests.service.redis_fixture import redis_server, redis_url  # noqa: F401

HOUR = 3600
DAY = 24 * HOUR
T0 = 1_700_006_400.0  # a day boundary: 19676 * 86400
BACKENDS = ["sqlite", "redis"]


def usage(request_id: str, prompt=100, cached=0, completion=10, tenant="acme", finished_at=T0) -> UsageRecord:
    return UsageRecord(request_id, tenant, "stories", prompt, cached, completion, "stop", finished_at - 1, finished_at)


@asynccontextmanager
async def open_ledger(kind: str, directory: Path, url: str, prefix: str = "test:"):
    if kind == "sqlite":
        ledger = SQLiteLedger(directory / "ledger.db")
    else:
        ledger = RedisLedger(create_redis(url), prefix, close_client=True)
    try:
        yield ledger
    finally:
        await ledger.close()


@pytest.mark.parametrize("kind", BACKENDS)
def test_record_counts_a_request_id_once(kind, tmp_path, redis_url):
    async def main():
        async with open_ledger(kind, tmp_path, redis_url) as ledger:
            first = await ledger.record(usage("r1", prompt=100, cached=40, completion=10), 1234)
            again = await ledger.record(usage("r1", prompt=999, cached=0, completion=999), 99999)
            return first, again, await ledger.totals("acme")

    assert asyncio.run(main()) == (True, False, UsageTotals(1, 100, 40, 10, 1234))


@pytest.mark.parametrize("kind", BACKENDS)
def test_same_request_id_recorded_100_times_at_once_counts_once(kind, tmp_path, redis_url):
    async def main():
        async with open_ledger(kind, tmp_path, redis_url) as ledger:
            results = await asyncio.gather(*(ledger.record(usage("same", 50, 20, 5), 777) for _ in range(100)))
            batch_new = await ledger.record_many([(usage("b1"), 1), (usage("b1"), 1), (usage("same"), 777)])
            return results, batch_new, await ledger.totals("acme")

    results, batch_new, totals = asyncio.run(main())
    assert results.count(True) == 1 and results.count(False) == 99
    assert batch_new == 1
    assert totals == UsageTotals(2, 150, 20, 15, 778)


@pytest.mark.parametrize("kind", BACKENDS)
def test_totals_are_kept_per_tenant(kind, tmp_path, redis_url):
    async def main():
        async with open_ledger(kind, tmp_path, redis_url) as ledger:
            await ledger.record_many([(usage("a1", tenant="acme"), 10), (usage("g1", tenant="globex"), 20),
                                      (usage("g2", tenant="globex"), 30)])
            return [await ledger.totals(t) for t in ("acme", "globex", "initech")]

    assert asyncio.run(main()) == [UsageTotals(1, 100, 0, 10, 10), UsageTotals(2, 200, 0, 20, 50), UsageTotals()]


@pytest.mark.parametrize("kind", BACKENDS)
def test_invalid_record_is_refused_and_not_stored(kind, tmp_path, redis_url):
    async def main():
        async with open_ledger(kind, tmp_path, redis_url) as ledger:
            with pytest.raises(ValueError, match=r"cached_tokens \(11\) exceeds prompt_tokens \(10\)"):
                await ledger.record(usage("bad", prompt=10, cached=11), 5)
            with pytest.raises(ValueError, match="cost_pico_usd must be an int >= 0"):
                await ledger.record(usage("bad"), -1)
            return await ledger.totals("acme")

    assert asyncio.run(main()) == UsageTotals()


def test_sqlite_range_is_half_open_and_exact(tmp_path):
    async def main():
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        for i, t in enumerate([T0 + 100, T0 + 200, T0 + 300]):
            await ledger.record(usage(f"r{i}", finished_at=t), 1)
        got = [await ledger.totals("acme", T0 + 100, T0 + 300), await ledger.totals("acme", since=T0 + 101),
               await ledger.totals("acme", until=T0 + 100)]
        await ledger.close()
        return [t.requests for t in got]

    assert asyncio.run(main()) == [2, 2, 0]


def test_sqlite_records_survive_reopening(tmp_path):
    async def main():
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        await ledger.record(usage("r1"), 5)
        await ledger.close()
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        result = await ledger.record(usage("r1"), 5), await ledger.totals("acme")
        await ledger.close()
        return result

    assert asyncio.run(main()) == (False, UsageTotals(1, 100, 0, 10, 5))


def test_redis_ranges_resolve_to_whole_hours(tmp_path, redis_url):
    # two records in hour 10; a range inside that hour counts both on Redis, none on SQLite
    records = [(usage("r1", finished_at=T0 + 10 * HOUR + 5), 1), (usage("r2", finished_at=T0 + 10 * HOUR + 3000), 2)]

    async def main():
        got = []
        for kind in BACKENDS:
            async with open_ledger(kind, tmp_path, redis_url) as ledger:
                await ledger.record_many(records)
                got.append(await ledger.totals("acme", T0 + 10 * HOUR + 1000, T0 + 10 * HOUR + 2000))
        return got

    sqlite_totals, redis_totals = asyncio.run(main())
    assert sqlite_totals == UsageTotals()
    assert redis_totals == UsageTotals(2, 200, 0, 20, 3)


def test_redis_multi_day_and_open_ended_ranges_match_sqlite(tmp_path, redis_url):
    # one record every 5 hours over 4 days: ranges mix hour buckets and whole-day buckets
    records = [(usage(f"r{i}", prompt=i, finished_at=T0 + i * 5 * HOUR + 17), i * 3) for i in range(20)]
    ranges = [(T0 + 5 * HOUR, T0 + 3 * DAY + 7 * HOUR), (T0 + DAY, T0 + 3 * DAY), (None, T0 + 2 * DAY + 2 * HOUR),
              (T0 + 30 * HOUR, None), (T0 - 5 * DAY, T0 + 50 * DAY), (T0 + 7 * HOUR, T0 + 7 * HOUR), (None, None)]

    async def main():
        got = {}
        for kind in BACKENDS:
            async with open_ledger(kind, tmp_path, redis_url) as ledger:
                await ledger.record_many(records)
                got[kind] = [await ledger.totals("acme", since, until) for since, until in ranges]
        return got

    got = asyncio.run(main())
    assert got["redis"] == got["sqlite"]
    assert got["sqlite"][0].requests == sum(1 for i in range(20) if 1 <= i < 16)
    assert got["sqlite"][-1] == UsageTotals(20, sum(range(20)), 0, 200, 3 * sum(range(20)))


token_splits = st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**5)).map(
    lambda t: (t[0] + t[1], t[1], t[2]))  # (prompt_tokens, cached_tokens, completion_tokens)
entries = st.lists(st.tuples(st.integers(0, 11), token_splits, st.integers(0, 3 * DAY - 1),
                             st.sampled_from(["acme", "globex"])), min_size=1, max_size=16)
micro_prices = st.tuples(st.integers(0, 10**7), st.integers(0, 10**7), st.integers(0, 10**8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=entries, prices=micro_prices, hours=st.tuples(st.integers(0, 72), st.integers(0, 72)))
def test_totals_equal_the_sum_of_distinct_records_on_both_backends(redis_server, entries, prices, hours):  # noqa: F811
    plan = PricePlan(*prices)
    records = [UsageRecord(f"req-{rid}", tenant, "m", prompt, cached, completion, "stop", T0, T0 + offset)
               for rid, (prompt, cached, completion), offset, tenant in entries]
    first = {}
    for record in records:
        first.setdefault(record.request_id, record)
    since, until = T0 + min(hours) * HOUR, T0 + max(hours) * HOUR

    async def main(directory):
        got = {}
        for kind in BACKENDS:
            async with open_ledger(kind, directory, redis_server.url, f"prop-{uuid.uuid4().hex}:") as ledger:
                for record in records[: len(records) // 2]:
                    await ledger.record(record, cost_pico_usd(record, plan))
                await ledger.record_many([(r, cost_pico_usd(r, plan)) for r in records[len(records) // 2:]])
                got[kind] = [(await ledger.totals(t), await ledger.totals(t, since, until)) for t in ("acme", "globex")]
        return got

    with tempfile.TemporaryDirectory() as directory:
        got = asyncio.run(main(Path(directory)))
    assert got["sqlite"] == got["redis"]
    for (all_time, ranged), tenant in zip(got["sqlite"], ("acme", "globex")):
        mine = [r for r in first.values() if r.tenant == tenant]
        assert all_time.requests == len(mine)
        assert all_time.prompt_tokens == sum(r.prompt_tokens for r in mine)
        assert all_time.cached_tokens == sum(r.cached_tokens for r in mine)
        assert all_time.completion_tokens == sum(r.completion_tokens for r in mine)
        assert all_time.cost_pico_usd == sum(cost_pico_usd(r, plan) for r in mine)
        # an outside reference: the bill in USD, with the cached rate for cached tokens
        usd = sum((Decimal(r.prompt_tokens - r.cached_tokens) * prices[0] + Decimal(r.cached_tokens) * prices[1]
                   + Decimal(r.completion_tokens) * prices[2]) / 10**12 for r in mine)
        assert Decimal(format_usd(all_time.cost_pico_usd)) == usd
        assert ranged.requests == sum(1 for r in mine if since <= r.finished_at < until)
        assert ranged.cost_pico_usd == sum(cost_pico_usd(r, plan) for r in mine if since <= r.finished_at < until)


def test_redis_totals_survive_a_server_restart(redis_server, redis_url):  # noqa: F811
    async def write():
        async with open_ledger("redis", Path(), redis_url) as ledger:
            await ledger.record(usage("r1"), 42)

    async def read():
        async with open_ledger("redis", Path(), redis_url) as ledger:
            return await ledger.totals("acme"), await ledger.record(usage("r1"), 42)

    asyncio.run(write())
    redis_server.restart()
    totals, again = asyncio.run(read())
    assert (totals, again) == (UsageTotals(1, 100, 0, 10, 42), False)
