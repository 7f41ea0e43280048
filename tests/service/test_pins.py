"""service/pins.py on SQLite and on a real redis-server: upsert, remove, ordered list, restarts."""

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from service.pins import Pin, RedisPinRegistry, SQLitePinRegistry
from service.redis_pool import create_redis
from tests.service.redis_fixture import redis_server, redis_url  # noqa: F401


@asynccontextmanager
async def open_registry(kind: str, directory: Path, url: str):
    if kind == "sqlite":
        registry = SQLitePinRegistry(directory / "pins.db")
    else:
        registry = RedisPinRegistry(create_redis(url), "test:", close_client=True)
    try:
        yield registry
    finally:
        await registry.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_pins_upsert_remove_and_list_in_order(kind, tmp_path, redis_url):  # noqa: F811
    async def main():
        async with open_registry(kind, tmp_path, redis_url) as pins:
            await pins.add("globex", "sys", "You are Globex's assistant.")
            await pins.add("acme", "sys", "You are a helpful assistant.")
            await pins.add("acme", "faq", "Q: what is acme?")
            await pins.add("acme", "sys", "You are Acme's assistant.")
            removed = await pins.remove("globex", "sys"), await pins.remove("globex", "sys")
            return removed, await pins.list()

    removed, listed = asyncio.run(main())
    assert removed == (True, False)
    assert [(p.tenant, p.pin_id, p.text) for p in listed] == [
        ("acme", "faq", "Q: what is acme?"), ("acme", "sys", "You are Acme's assistant.")]
    assert all(isinstance(p, Pin) and p.created_at > 1.7e9 for p in listed)


def test_sqlite_pins_survive_a_restart(tmp_path):
    async def main():
        async with open_registry("sqlite", tmp_path, "") as pins:
            await pins.add("acme", "sys", "hello")
        async with open_registry("sqlite", tmp_path, "") as pins:
            return await pins.list()

    assert [(p.tenant, p.pin_id, p.text) for p in asyncio.run(main())] == [("acme", "sys", "hello")]


def test_redis_pins_survive_a_server_restart(redis_server, redis_url):  # noqa: F811
    async def write():
        async with open_registry("redis", Path(), redis_url) as pins:
            await pins.add("acme", "sys", "hello")

    async def read():
        async with open_registry("redis", Path(), redis_url) as pins:
            return await pins.list()

    asyncio.run(write())
    redis_server.restart()
    assert [(p.tenant, p.pin_id, p.text) for p in asyncio.run(read())] == [("acme", "sys", "hello")]


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_an_operators_pin_is_kept_as_the_operators(kind, tmp_path, redis_url):  # noqa: F811
    async def main():
        async with open_registry(kind, tmp_path, redis_url) as pins:
            await pins.add("acme", "house", "The house rules.", by_operator=True)
            await pins.add("acme", "own", "Acme's own prompt.")
            first = await pins.list()
            await pins.add("acme", "house", "The house rules, as acme's now.")  # re-pinned by the tenant
            return first, await pins.list()

    first, second = asyncio.run(main())
    assert [(p.pin_id, p.by_operator) for p in first] == [("house", True), ("own", False)]
    assert [(p.pin_id, p.by_operator) for p in second] == [("house", False), ("own", False)]


def test_a_pins_file_from_before_operator_pins_reads_as_the_tenants(tmp_path):
    import sqlite3

    with sqlite3.connect(tmp_path / "pins.db") as db:  # the table as it was
        db.execute("CREATE TABLE pins (tenant TEXT NOT NULL, pin_id TEXT NOT NULL, text TEXT NOT NULL, "
                   "created_at REAL NOT NULL, PRIMARY KEY (tenant, pin_id))")
        db.execute("INSERT INTO pins VALUES ('acme', 'sys', 'You are Acme''s assistant.', 1.0)")

    async def main():
        registry = SQLitePinRegistry(tmp_path / "pins.db")
        try:
            await registry.add("acme", "house", "The house rules.", by_operator=True)
            return await registry.list()
        finally:
            await registry.close()

    house, sys_pin = asyncio.run(main())
    assert (house.pin_id, house.by_operator) == ("house", True)
    assert sys_pin == Pin("acme", "sys", "You are Acme's assistant.", 1.0, False)
