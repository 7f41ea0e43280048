"""service/responses_store.py on SQLite and on a real redis-server: per-tenant keys, updates, deletes, retention."""

import asyncio
import time
from pathlib import Path

import pytest

from service.redis_pool import create_redis
from service.responses_store import RedisResponseStore, SQLiteResponseStore, StoredResponse
from tests.service.redis_fixture import redis_server, redis_url  # noqa: F401


def _stored(status: str) -> StoredResponse:
    return StoredResponse({"id": "resp_1", "status": status}, [{"id": "msg_1", "type": "message"}],
                          [{"role": "user", "content": "hi"}])


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _open(kind: str, directory: Path, url: str, retention_s: float, clock: Clock | None = None):
    if kind == "sqlite":
        return SQLiteResponseStore(directory / "responses.db", retention_s, clock=clock or time.time)
    return RedisResponseStore(create_redis(url), retention_s, key_prefix=f"test-{time.time_ns()}:")


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_a_response_is_its_tenants_only_and_updates_keep_it(kind, tmp_path, redis_url):  # noqa: F811
    async def main():
        store = _open(kind, tmp_path, redis_url, 3600)
        try:
            await store.put("acme", "resp_1", _stored("in_progress"))
            await store.put("acme", "resp_1", _stored("completed"))  # the run's end replaces its start
            mine, theirs = await store.get("acme", "resp_1"), await store.get("globex", "resp_1")
            # a tenant id that would collide with another's key if keys were joined naively
            await store.put("a", "cme:resp_1", _stored("other"))
            still_mine = await store.get("acme", "resp_1")
            deleted = await store.delete("globex", "resp_1"), await store.delete("acme", "resp_1")
            return mine, theirs, still_mine, deleted, await store.get("acme", "resp_1")
        finally:
            await store.close()
            if kind == "redis":
                await store._redis.aclose()

    mine, theirs, still_mine, deleted, gone = asyncio.run(main())
    assert mine == _stored("completed") and theirs is None and still_mine == _stored("completed")
    assert deleted == (False, True) and gone is None


def test_sqlite_responses_expire_after_the_retention_time_and_are_pruned(tmp_path):
    clock = Clock()

    async def main():
        store = _open("sqlite", tmp_path, "", retention_s=60, clock=clock)
        try:
            await store.put("acme", "old", _stored("completed"))
            clock.now += 59
            kept = await store.get("acme", "old")
            clock.now += 2
            expired = await store.get("acme", "old"), await store.delete("acme", "old")
            await store.put("acme", "new", _stored("completed"))  # a write prunes the expired rows
            rows = await store._db.call(lambda: store._db.conn.execute("SELECT response_id FROM responses").fetchall())
            return kept, expired, rows
        finally:
            await store.close()

    kept, expired, rows = asyncio.run(main())
    assert kept is not None and expired == (None, False) and rows == [("new",)]


def test_redis_responses_expire_after_the_retention_time(redis_url):  # noqa: F811
    async def main():
        store = _open("redis", Path(), redis_url, retention_s=0.3)
        try:
            await store.put("acme", "resp_1", _stored("in_progress"))
            await asyncio.sleep(0.15)
            await store.put("acme", "resp_1", _stored("completed"))  # an update keeps the first put's clock
            kept = await store.get("acme", "resp_1")
            await asyncio.sleep(0.3)
            return kept, await store.get("acme", "resp_1")
        finally:
            await store._redis.aclose()

    kept, expired = asyncio.run(main())
    assert kept == _stored("completed") and expired is None
