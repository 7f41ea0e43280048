"""service/prefix_index.py: longest cached prefix per live replica, in process and in Redis."""

import asyncio
import hashlib
from contextlib import asynccontextmanager

import pytest

from service.prefix_index import MemoryPrefixIndex, RedisPrefixIndex
from service.redis_pool import create_redis
from tests.service.redis_fixture import redis_server, redis_url  # noqa: F401

BACKENDS = ["memory", "redis"]
H = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(6)]


@asynccontextmanager
async def open_index(kind: str, url: str, ttl_s: float = 30.0, clock=None):
    if kind == "memory":
        index = MemoryPrefixIndex(ttl_s, clock) if clock else MemoryPrefixIndex(ttl_s)
    else:
        index = RedisPrefixIndex(create_redis(url), "px:", ttl_s, close_client=True)
    try:
        yield index
    finally:
        await index.close()


@pytest.mark.parametrize("kind", BACKENDS)
def test_lookup_counts_the_leading_blocks_each_replica_holds(kind, redis_url):
    async def main():
        async with open_index(kind, redis_url) as index:
            await index.publish("a", [H[0], H[1], H[2]], [])
            await index.publish("b", [H[0], H[2], H[3]], [])
            return [await index.lookup(hashes) for hashes in ([H[0], H[1], H[2], H[3]], [H[1], H[2]], [H[5]], [])]

    assert asyncio.run(main()) == [{"a": 3, "b": 1}, {"a": 2, "b": 0}, {"a": 0, "b": 0}, {"a": 0, "b": 0}]


@pytest.mark.parametrize("kind", BACKENDS)
def test_removed_blocks_stop_counting(kind, redis_url):
    async def main():
        async with open_index(kind, redis_url) as index:
            await index.publish("a", [H[0], H[1], H[2]], [])
            await index.publish("a", [H[3]], [H[1]])
            return await index.lookup([H[0], H[1], H[2], H[3]]), await index.lookup([H[2], H[3]])

    assert asyncio.run(main()) == ({"a": 1}, {"a": 2})


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_block_stored_and_removed_in_one_publish_is_absent(kind, redis_url):
    async def main():
        async with open_index(kind, redis_url) as index:
            await index.publish("a", [H[0], H[1]], [H[1]])
            return await index.lookup([H[0], H[1]])

    assert asyncio.run(main()) == {"a": 1}


@pytest.mark.parametrize("kind", BACKENDS)
def test_an_index_with_no_replicas_answers_empty(kind, redis_url):
    async def main():
        async with open_index(kind, redis_url) as index:
            return await index.lookup([H[0]])

    assert asyncio.run(main()) == {}


def test_memory_replica_whose_heartbeat_stops_disappears_after_ttl():
    class Clock:
        now = 100.0

        def __call__(self):
            return self.now

    clock = Clock()

    async def main():
        async with open_index("memory", "", ttl_s=5.0, clock=clock) as index:
            await index.publish("a", [H[0], H[1]], [])
            await index.publish("b", [H[0]], [])
            clock.now = 103.0
            await index.heartbeat("b")
            clock.now = 104.9
            both = await index.lookup([H[0], H[1]])
            clock.now = 105.0
            only_b = await index.lookup([H[0], H[1]])
            await index.heartbeat("a")  # back after its ttl: it starts empty and must publish again
            return both, only_b, await index.lookup([H[0], H[1]])

    assert asyncio.run(main()) == ({"a": 2, "b": 1}, {"b": 1}, {"a": 0, "b": 1})


def test_redis_replica_whose_heartbeat_stops_disappears_after_ttl(redis_url):
    async def main():
        async with open_index("redis", redis_url, ttl_s=0.8) as index:
            await index.publish("a", [H[0], H[1]], [])
            await index.publish("b", [H[0]], [])
            both = await index.lookup([H[0], H[1]])
            for _ in range(5):  # a's heartbeat is 1.0 s old after this, b's at most 0.2 s
                await asyncio.sleep(0.2)
                await index.heartbeat("b")
            only_b = await index.lookup([H[0], H[1]])
            client = create_redis(redis_url)
            keys = sorted(k.decode() for k in await client.keys("px:prefix:blocks:*"))
            await client.aclose()
            return both, only_b, keys

    assert asyncio.run(main()) == ({"a": 2, "b": 1}, {"b": 1}, ["px:prefix:blocks:b"])
