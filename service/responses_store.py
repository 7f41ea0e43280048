"""Where stored Responses API responses live: per tenant, deleted after the retention time.

A tenant only ever reaches its own: the tenant is part of every key, so another tenant's id,
guessed or leaked, reads as "not found". SQLite (embedded) or Redis (shared by replicas):

    SQLite   table responses (tenant, response_id) -> JSON StoredResponse, expires_at
             in <data_dir>/responses.sqlite3; expired rows are deleted as new ones are written
    Redis    {prefix}response:{len(tenant)}:{tenant}:{response_id} -> JSON StoredResponse, with a TTL
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from service.sqlite_thread import SQLiteThread


class StoredResponse(msgspec.Struct):
    """One response as kept: the response object, its own input items, and the conversation so far.

    context: the chat messages a turn continuing it reads first (every earlier turn's input and
    answer, then this one's; never instructions, which OpenAI does not carry over).
    """

    response: dict
    input_items: list[dict]
    context: list[dict]


class ResponseStore(Protocol):
    """Stored responses by (tenant, id). Every method is a coroutine on the service's loop."""

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        """Insert or replace; the retention clock starts at the first put."""

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response, or None (never stored, expired, deleted, or another tenant's)."""

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Delete it; False if the tenant has no such response."""

    async def close(self) -> None:
        """Release what the store holds."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL,
    response_id TEXT NOT NULL,
    body BLOB NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (tenant, response_id)
);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses (expires_at);
"""


class SQLiteResponseStore:
    """Responses in one SQLite file, used from one worker thread."""

    def __init__(self, path: str | Path, retention_s: float, *, clock: Callable[[], float] = time.time) -> None:
        self.retention_s = retention_s
        self._clock = clock
        # NORMAL: crash-safe; a power cut may lose the last few writes (the bill is the usage journal's, not this)
        self._db = SQLiteThread(path, _SCHEMA, synchronous="NORMAL", name="sqlite-responses")

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        """Insert or replace; the retention clock starts at the first put."""
        body = msgspec.json.encode(stored)

        def upsert() -> None:
            now = self._clock()
            self._db.conn.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))
            self._db.conn.execute(
                "INSERT INTO responses (tenant, response_id, body, expires_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (tenant, response_id) DO UPDATE SET body = excluded.body",
                (tenant, response_id, body, now + self.retention_s))
        await self._db.call(upsert)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response, or None."""
        def select() -> bytes | None:
            row = self._db.conn.execute("SELECT body FROM responses WHERE tenant = ? AND response_id = ? AND expires_at > ?",
                                     (tenant, response_id, self._clock())).fetchone()
            return None if row is None else row[0]
        body = await self._db.call(select)
        return None if body is None else msgspec.json.decode(body, type=StoredResponse)

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Delete it; False if the tenant has no such response."""
        def delete() -> bool:
            return self._db.conn.execute("DELETE FROM responses WHERE tenant = ? AND response_id = ? AND expires_at > ?",
                                      (tenant, response_id, self._clock())).rowcount == 1
        return await self._db.call(delete)

    async def close(self) -> None:
        """Close the database and stop the worker thread."""
        await self._db.close()


class RedisResponseStore:
    """Responses as Redis strings with a TTL, shared by every replica. The client is the caller's."""

    def __init__(self, redis_client, retention_s: float, key_prefix: str = "pagedserve:") -> None:
        self._redis = redis_client
        self.retention_s = retention_s
        self._prefix = f"{key_prefix}response:"

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self._prefix}{len(tenant)}:{tenant}:{response_id}"  # the length: no tenant id can forge another's key

    async def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        """Insert or replace; the retention clock starts at the first put (KEEPTTL on updates)."""
        key, body = self._key(tenant, response_id), msgspec.json.encode(stored)
        if not await self._redis.set(key, body, xx=True, keepttl=True):
            await self._redis.set(key, body, px=max(1, int(self.retention_s * 1000)))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response, or None."""
        body = await self._redis.get(self._key(tenant, response_id))
        return None if body is None else msgspec.json.decode(body, type=StoredResponse)

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Delete it; False if the tenant has no such response."""
        return await self._redis.delete(self._key(tenant, response_id)) == 1

    async def close(self) -> None:
        """Nothing: the client is closed by its owner."""
