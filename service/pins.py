"""The pinned-prefix registry: which system prompts each tenant asked to keep resident.

The engine holds a pin's pages; this registry holds the pins themselves, so they survive a
restart (the service re-pins them at start-up). SQLite (embedded) or Redis (shared by
replicas), one interface:

    SQLite   table pins (tenant, pin_id) -> text, created_at          in <data_dir>/pins.sqlite3
    Redis    {prefix}pins   hash: JSON [tenant, pin_id] -> JSON Pin
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from service.sqlite_thread import SQLiteThread


class Pin(msgspec.Struct, frozen=True):
    """A prefix pinned for a tenant; created_at is the time of its latest add (unix s). by_operator: an admin
    key pinned it (its pages are not the tenant's to count, its prefill not the tenant's to pay)."""

    tenant: str
    pin_id: str
    text: str
    created_at: float
    by_operator: bool = False


class PinRegistry(Protocol):
    """Where pins are kept. Every method is a coroutine on the service's loop."""

    async def add(self, tenant: str, pin_id: str, text: str, by_operator: bool = False) -> None:
        """Insert or replace the pin (tenant, pin_id)."""

    async def remove(self, tenant: str, pin_id: str) -> bool:
        """Delete the pin; False if there was none."""

    async def list(self) -> list[Pin]:
        """Every pin, ordered by (tenant, pin_id)."""

    async def close(self) -> None:
        """Release what the registry holds."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS pins (
    tenant TEXT NOT NULL,
    pin_id TEXT NOT NULL,
    text TEXT NOT NULL,
    created_at REAL NOT NULL,
    by_operator INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, pin_id)
);
"""


def _add_by_operator(conn) -> None:
    """A pins table from before operator pins were told apart: every pin in it was the tenant's own."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(pins)")}
    if "by_operator" not in columns:
        conn.execute("ALTER TABLE pins ADD COLUMN by_operator INTEGER NOT NULL DEFAULT 0")


class SQLitePinRegistry:
    """Pins in one SQLite file, used from one worker thread."""

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._clock = clock
        self._db = SQLiteThread(path, _SCHEMA, name="sqlite-pins", migrate=_add_by_operator)

    async def add(self, tenant: str, pin_id: str, text: str, by_operator: bool = False) -> None:
        """Insert or replace the pin (tenant, pin_id)."""
        def upsert() -> None:
            self._db.conn.execute(
                "INSERT INTO pins (tenant, pin_id, text, created_at, by_operator) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (tenant, pin_id) DO UPDATE SET text = excluded.text, created_at = excluded.created_at,"
                " by_operator = excluded.by_operator",
                (tenant, pin_id, text, self._clock(), int(by_operator)))
        await self._db.call(upsert)

    async def remove(self, tenant: str, pin_id: str) -> bool:
        """Delete the pin; False if there was none."""
        def delete() -> bool:
            return self._db.conn.execute("DELETE FROM pins WHERE tenant = ? AND pin_id = ?",
                                      (tenant, pin_id)).rowcount == 1
        return await self._db.call(delete)

    async def list(self) -> list[Pin]:
        """Every pin, ordered by (tenant, pin_id)."""
        def select() -> list[Pin]:
            rows = self._db.conn.execute(
                "SELECT tenant, pin_id, text, created_at, by_operator FROM pins ORDER BY tenant, pin_id")
            return [Pin(tenant, pin_id, text, created_at, bool(by_operator))
                    for tenant, pin_id, text, created_at, by_operator in rows]
        return await self._db.call(select)

    async def close(self) -> None:
        """Close the database and stop the worker thread."""
        await self._db.close()


class RedisPinRegistry:
    """Pins in one Redis hash, shared by every replica. The client is the caller's."""

    def __init__(self, redis_client, key_prefix: str = "pagedserve:", *, close_client: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self._redis = redis_client
        self._key = f"{key_prefix}pins"
        self._close_client = close_client
        self._clock = clock

    @staticmethod
    def _field(tenant: str, pin_id: str) -> bytes:
        return msgspec.json.encode([tenant, pin_id])

    async def add(self, tenant: str, pin_id: str, text: str, by_operator: bool = False) -> None:
        """Insert or replace the pin (tenant, pin_id)."""
        pin = Pin(tenant, pin_id, text, self._clock(), by_operator)
        await self._redis.hset(self._key, self._field(tenant, pin_id), msgspec.json.encode(pin))

    async def remove(self, tenant: str, pin_id: str) -> bool:
        """Delete the pin; False if there was none."""
        return await self._redis.hdel(self._key, self._field(tenant, pin_id)) == 1

    async def list(self) -> list[Pin]:
        """Every pin, ordered by (tenant, pin_id)."""
        pins = [msgspec.json.decode(value, type=Pin) for value in await self._redis.hvals(self._key)]
        return sorted(pins, key=lambda pin: (pin.tenant, pin.pin_id))

    async def close(self) -> None:
        """Close the Redis client if this registry owns it."""
        if self._close_client:
            await self._redis.aclose()
