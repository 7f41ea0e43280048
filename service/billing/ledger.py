"""The usage ledger: SQLite (embedded) or Redis (shared), one interface.

Both backends count a request id once: `record` returns False for an id already recorded, so
retries and journal replays are safe. All money is integer pico-USD (see service/billing/usage.py).

SQLite keeps every record and answers any [since, until) range exactly.

Redis keeps integer counters (HINCRBY only, never floats), one hash per tenant per bucket:

    {prefix}usage:{tenant}:h:{hour}    hour = floor(finished_at / 3600)    fields: requests,
    {prefix}usage:{tenant}:d:{day}     day  = floor(finished_at / 86400)           prompt_tokens,
    {prefix}usage:{tenant}:total       all time, + first_hour, last_hour           cached_tokens,
    {prefix}usage-seen:{request_id}    "1", SET NX, expires after 30 days          completion_tokens,
                                                                                   cost_pico_usd

so a ranged Redis query resolves to the hour: it sums every hour bucket that overlaps
[since, until) (whole days of the range read the day buckets instead). Counters are signed
64-bit, as are SQLite's per-day sums: 9.2e18 pico-USD, about 9.2 million USD per counter.
Redis Cluster is not supported (the record script touches keys of several slots).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from service.billing.usage import UsageRecord, UsageTotals

SECONDS_PER_HOUR = 3600
HOURS_PER_DAY = 24
DEDUPE_TTL_S = 30 * 24 * 3600
COUNTER_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_pico_usd")


class Ledger(Protocol):
    """Where usage records are kept. Every method is a coroutine on the service's loop."""

    async def record(self, record: UsageRecord, cost_pico_usd: int) -> bool:
        """Apply `record` once; False if its request_id was already recorded."""

    async def record_many(self, items: Sequence[tuple[UsageRecord, int]]) -> int:
        """Apply a batch of (record, cost) in order, each once; returns how many were new."""

    async def totals(self, tenant: str, since: float | None = None, until: float | None = None) -> UsageTotals:
        """Sums over the tenant's records with finished_at in [since, until) (None: unbounded)."""

    async def close(self) -> None:
        """Release what the ledger holds."""


def check_entry(record: UsageRecord, cost_pico_usd: int) -> None:
    """Raise ValueError for a record a ledger must not store (negative counts, cached > prompt, bad cost)."""
    record.check_counts()
    if not isinstance(cost_pico_usd, int) or isinstance(cost_pico_usd, bool) or cost_pico_usd < 0:
        raise ValueError(f"usage record {record.request_id!r}: cost_pico_usd must be an int >= 0, "
                         f"got {cost_pico_usd!r}")


# ---------------------------------------------------------------------------------------------- SQLite

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost_pico_usd INTEGER NOT NULL,
    finish_reason TEXT NOT NULL,
    created_at REAL NOT NULL,
    finished_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_by_tenant_time ON usage (tenant, finished_at);
"""

_INSERT = """INSERT OR IGNORE INTO usage (request_id, tenant, model, prompt_tokens, cached_tokens,
    completion_tokens, cost_pico_usd, finish_reason, created_at, finished_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""


class SQLiteLedger:
    """The embedded ledger: one SQLite file in WAL mode, used from one worker thread.

    Every record is a row under a UNIQUE request_id (INSERT OR IGNORE dedupes); commits are
    synchronous=FULL, so an acknowledged record survives a crash. Sums are taken per day in SQL
    and added in Python, so no single SQL sum nears the 64-bit limit.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-ledger")
        self._executor.submit(self._open).result()

    def _open(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=10.0)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.executescript(_SCHEMA)
        self._conn = conn

    async def _call(self, fn, *args):
        if self._conn is None:
            raise RuntimeError(f"the SQLite ledger {self.path} is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _insert(self, items: Sequence[tuple[UsageRecord, int]]) -> int:
        conn = self._conn
        num_new = 0
        conn.execute("BEGIN IMMEDIATE")
        try:
            for record, cost in items:
                num_new += conn.execute(_INSERT, (
                    record.request_id, record.tenant, record.model, record.prompt_tokens, record.cached_tokens,
                    record.completion_tokens, cost, record.finish_reason, record.created_at, record.finished_at,
                )).rowcount
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return num_new

    async def record(self, record: UsageRecord, cost_pico_usd: int) -> bool:
        """Apply `record` once; False if its request_id was already recorded."""
        return await self.record_many([(record, cost_pico_usd)]) == 1

    async def record_many(self, items: Sequence[tuple[UsageRecord, int]]) -> int:
        """Apply a batch in one transaction; returns how many request ids were new."""
        for record, cost in items:
            check_entry(record, cost)
        return await self._call(self._insert, list(items)) if items else 0

    def _totals(self, tenant: str, since: float | None, until: float | None) -> UsageTotals:
        where, params = ["tenant = ?"], [tenant]
        if since is not None:
            where.append("finished_at >= ?")
            params.append(since)
        if until is not None:
            where.append("finished_at < ?")
            params.append(until)
        rows = self._conn.execute(
            "SELECT COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens), SUM(cost_pico_usd)"
            f" FROM usage WHERE {' AND '.join(where)} GROUP BY CAST(finished_at / 86400 AS INTEGER)", params)
        totals = UsageTotals()
        for requests, prompt, cached, completion, cost in rows:
            totals.requests += requests
            totals.prompt_tokens += prompt
            totals.cached_tokens += cached
            totals.completion_tokens += completion
            totals.cost_pico_usd += cost
        return totals

    async def totals(self, tenant: str, since: float | None = None, until: float | None = None) -> UsageTotals:
        """Exact sums over the tenant's records with finished_at in [since, until)."""
        return await self._call(self._totals, tenant, since, until)

    async def close(self) -> None:
        """Close the database and stop the worker thread."""
        if self._conn is None:
            return
        await self._call(self._conn.close)
        self._conn = None
        self._executor.shutdown(wait=True)


# ----------------------------------------------------------------------------------------------- Redis

# KEYS: seen, hour bucket, day bucket, all-time total
# ARGV: seen ttl (s), hour index, prompt_tokens, cached_tokens, completion_tokens, cost_pico_usd
_RECORD_LUA = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
for i = 2, 4 do
  redis.call('HINCRBY', KEYS[i], 'requests', 1)
  redis.call('HINCRBY', KEYS[i], 'prompt_tokens', ARGV[3])
  redis.call('HINCRBY', KEYS[i], 'cached_tokens', ARGV[4])
  redis.call('HINCRBY', KEYS[i], 'completion_tokens', ARGV[5])
  redis.call('HINCRBY', KEYS[i], 'cost_pico_usd', ARGV[6])
end
local hour = tonumber(ARGV[2])
local first = redis.call('HGET', KEYS[4], 'first_hour')
if not first or hour < tonumber(first) then redis.call('HSET', KEYS[4], 'first_hour', ARGV[2]) end
local last = redis.call('HGET', KEYS[4], 'last_hour')
if not last or hour > tonumber(last) then redis.call('HSET', KEYS[4], 'last_hour', ARGV[2]) end
return 1
"""


def _int(value) -> int:
    return 0 if value is None else int(value)


class RedisLedger:
    """The shared ledger: per-tenant hourly, daily and all-time counters in Redis (see module doc).

    `record` is one Lua script: SET NX on the request id's dedupe key, and only if it was new,
    HINCRBY of the hour, day and total hashes, all atomically. The client is the caller's
    (build it with service.redis_pool.create_redis); `close()` closes it only if `close_client`.
    """

    def __init__(self, redis_client, key_prefix: str = "pagedserve:", *, close_client: bool = False,
                 dedupe_ttl_s: int = DEDUPE_TTL_S) -> None:
        self._redis = redis_client
        self._prefix = key_prefix
        self._close_client = close_client
        self._dedupe_ttl_s = dedupe_ttl_s
        self._record_script = redis_client.register_script(_RECORD_LUA)

    def _bucket_key(self, tenant: str, bucket: str) -> str:
        return f"{self._prefix}usage:{tenant}:{bucket}"

    def _script_call(self, record: UsageRecord, cost: int, client):
        check_entry(record, cost)
        hour = int(record.finished_at // SECONDS_PER_HOUR)
        keys = [f"{self._prefix}usage-seen:{record.request_id}",
                self._bucket_key(record.tenant, f"h:{hour}"),
                self._bucket_key(record.tenant, f"d:{hour // HOURS_PER_DAY}"),
                self._bucket_key(record.tenant, "total")]
        args = [self._dedupe_ttl_s, hour, record.prompt_tokens, record.cached_tokens, record.completion_tokens, cost]
        return self._record_script(keys=keys, args=args, client=client)

    async def record(self, record: UsageRecord, cost_pico_usd: int) -> bool:
        """Apply `record` once; False if its request_id was already recorded."""
        return int(await self._script_call(record, cost_pico_usd, None)) == 1

    async def record_many(self, items: Sequence[tuple[UsageRecord, int]]) -> int:
        """Apply a batch in one pipeline of record scripts (each atomic); returns how many were new."""
        if not items:
            return 0
        for record, cost in items:
            check_entry(record, cost)
        async with self._redis.pipeline(transaction=False) as pipe:
            for record, cost in items:
                await self._script_call(record, cost, pipe)
            results = await pipe.execute()
        return sum(int(r) for r in results)

    async def totals(self, tenant: str, since: float | None = None, until: float | None = None) -> UsageTotals:
        """Sums over the tenant's counters; a range covers every hour bucket overlapping [since, until)."""
        total_key = self._bucket_key(tenant, "total")
        if since is None and until is None:
            return self._to_totals([await self._redis.hmget(total_key, COUNTER_FIELDS)])
        first_hour, last_hour = await self._redis.hmget(total_key, ["first_hour", "last_hour"])
        if first_hour is None:
            return UsageTotals()
        start_hour = int(first_hour)  # hours [start_hour, end_hour) overlap the range
        end_hour = int(last_hour) + 1
        if since is not None:
            start_hour = max(start_hour, int(since // SECONDS_PER_HOUR))
        if until is not None:
            end_hour = min(end_hour, int(-(-until // SECONDS_PER_HOUR)))
        async with self._redis.pipeline(transaction=False) as pipe:
            for bucket in _buckets(start_hour, end_hour):
                pipe.hmget(self._bucket_key(tenant, bucket), COUNTER_FIELDS)
            rows = await pipe.execute()
        return self._to_totals(rows)

    @staticmethod
    def _to_totals(rows) -> UsageTotals:
        sums = [0] * len(COUNTER_FIELDS)
        for row in rows:
            for i, value in enumerate(row):
                sums[i] += _int(value)
        return UsageTotals(*sums)

    async def close(self) -> None:
        """Close the Redis client if this ledger owns it."""
        if self._close_client:
            await self._redis.aclose()


def _buckets(start_hour: int, end_hour: int) -> list[str]:
    """Bucket names covering hours [start_hour, end_hour): whole days as day buckets, the rest as hours.

        hours:  |h h h|ddddddddddddddddddddddddd|ddddddd...|h h|
                 start  first whole day                     end
    """
    first_day = -(-start_hour // HOURS_PER_DAY)
    end_day = end_hour // HOURS_PER_DAY
    if first_day >= end_day:
        return [f"h:{hour}" for hour in range(start_hour, end_hour)]
    return ([f"h:{hour}" for hour in range(start_hour, first_day * HOURS_PER_DAY)]
            + [f"d:{day}" for day in range(first_day, end_day)]
            + [f"h:{hour}" for hour in range(end_day * HOURS_PER_DAY, end_hour)])
