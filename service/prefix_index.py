"""The cluster-wide prefix index: which replica holds which cached KV block, by block hash.

Replicas publish the block hashes they stored and removed (the engine's KV events; hashes are
opaque bytes, already salted) and heartbeat. A router asks `lookup(block_hashes)` with the
chained hashes of a prompt's full blocks and gets, for every live replica, how many leading
blocks it holds: its longest cached prefix, in blocks.

    hashes:       h0  h1  h2  h3
    replica a:    x   x   x   .     -> 3
    replica b:    x   .   x   x     -> 1   (a block past a gap cannot be used)

A replica is live while its latest heartbeat (or publish) is younger than ttl_s. Within one
publish, `stored` is applied before `removed`, so a hash in both ends up absent: a missed hit
costs a recompute, a false hit would send a request where the pages are not.

Redis keys:

    {prefix}prefix:blocks:{replica_id}   set of hex hashes; PEXPIRE ttl_s, refreshed by heartbeat
                                         and publish (a replica silent for ttl_s loses its set and
                                         must publish its whole cache again)
    {prefix}prefix:replicas              zset replica_id -> latest heartbeat (unix s, the
                                         replica's clock: keep clocks in sync, well under ttl_s)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class PrefixIndex(Protocol):
    """Which replica holds which block; every method is a coroutine on the service's loop."""

    async def publish(self, replica_id: str, stored: list[bytes], removed: list[bytes]) -> None:
        """Add `stored` to and drop `removed` from the replica's blocks; counts as a heartbeat."""

    async def heartbeat(self, replica_id: str) -> None:
        """Keep the replica (and its blocks) live for another ttl_s."""

    async def lookup(self, block_hashes: list[bytes]) -> dict[str, int]:
        """For each live replica, how many leading hashes of `block_hashes` it holds."""

    async def close(self) -> None:
        """Release what the index holds."""


def _leading_hits(hits) -> int:
    count = 0
    for hit in hits:
        if not hit:
            break
        count += 1
    return count


class MemoryPrefixIndex:
    """The embedded index, in this process; `clock` returns seconds (monotonic is fine here)."""

    def __init__(self, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._blocks: dict[str, set[bytes]] = {}
        self._last_seen: dict[str, float] = {}

    async def publish(self, replica_id: str, stored: list[bytes], removed: list[bytes]) -> None:
        """Add `stored` to and drop `removed` from the replica's blocks; counts as a heartbeat."""
        await self.heartbeat(replica_id)
        blocks = self._blocks.setdefault(replica_id, set())
        blocks.update(stored)
        blocks.difference_update(removed)

    async def heartbeat(self, replica_id: str) -> None:
        """Keep the replica (and its blocks) live for another ttl_s."""
        if not self._is_live(replica_id, self._clock()):
            self._blocks.pop(replica_id, None)  # as in Redis: a replica silent past ttl_s starts empty
        self._last_seen[replica_id] = self._clock()

    def _is_live(self, replica_id: str, now: float) -> bool:
        last_seen = self._last_seen.get(replica_id)
        return last_seen is not None and now - last_seen < self._ttl_s

    async def lookup(self, block_hashes: list[bytes]) -> dict[str, int]:
        """For each live replica, how many leading hashes of `block_hashes` it holds."""
        now = self._clock()
        for replica_id in [r for r in self._last_seen if not self._is_live(r, now)]:
            del self._last_seen[replica_id]
            self._blocks.pop(replica_id, None)
        return {replica_id: _leading_hits(h in self._blocks.get(replica_id, ()) for h in block_hashes)
                for replica_id in self._last_seen}

    async def close(self) -> None:
        """Nothing to release."""


class RedisPrefixIndex:
    """The shared index: a Redis set of hex hashes per replica and a zset of heartbeats (see module doc)."""

    def __init__(self, redis_client, key_prefix: str = "pagedserve:", ttl_s: float = 30.0, *,
                 clock: Callable[[], float] = time.time, close_client: bool = False) -> None:
        self._redis = redis_client
        self._prefix = key_prefix
        self._ttl_s = ttl_s
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._clock = clock
        self._close_client = close_client
        self._replicas_key = f"{key_prefix}prefix:replicas"

    def _blocks_key(self, replica_id: str) -> str:
        return f"{self._prefix}prefix:blocks:{replica_id}"

    def _queue_heartbeat(self, pipe, replica_id: str) -> None:
        now = self._clock()
        pipe.pexpire(self._blocks_key(replica_id), self._ttl_ms)
        pipe.zadd(self._replicas_key, {replica_id: now})
        pipe.zremrangebyscore(self._replicas_key, "-inf", f"({now - self._ttl_s!r}")

    async def publish(self, replica_id: str, stored: list[bytes], removed: list[bytes]) -> None:
        """SADD `stored`, SREM `removed`, refresh the replica's TTL and heartbeat: one pipeline."""
        key = self._blocks_key(replica_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            if stored:
                pipe.sadd(key, *(h.hex() for h in stored))
            if removed:
                pipe.srem(key, *(h.hex() for h in removed))
            self._queue_heartbeat(pipe, replica_id)
            await pipe.execute()

    async def heartbeat(self, replica_id: str) -> None:
        """Keep the replica (and its blocks) live for another ttl_s."""
        async with self._redis.pipeline(transaction=True) as pipe:
            self._queue_heartbeat(pipe, replica_id)
            await pipe.execute()

    async def lookup(self, block_hashes: list[bytes]) -> dict[str, int]:
        """Live replicas from the heartbeat zset, then one pipeline of SMISMEMBER, one per replica."""
        now = self._clock()
        live = await self._redis.zrangebyscore(self._replicas_key, f"({now - self._ttl_s!r}", "+inf")
        replica_ids = [r.decode() if isinstance(r, bytes) else r for r in live]
        if not block_hashes or not replica_ids:
            return {replica_id: 0 for replica_id in replica_ids}
        members = [h.hex() for h in block_hashes]
        async with self._redis.pipeline(transaction=False) as pipe:
            for replica_id in replica_ids:
                pipe.smismember(self._blocks_key(replica_id), members)
            results = await pipe.execute()
        return {replica_id: _leading_hits(hits) for replica_id, hits in zip(replica_ids, results)}

    async def close(self) -> None:
        """Close the Redis client if this index owns it."""
        if self._close_client:
            await self._redis.aclose()
