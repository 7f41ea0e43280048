"""One asyncio Redis client for the ledger, pins, rate limits and prefix index, on a blocking pool.

redis-py's plain async `ConnectionPool` raises "Too many connections" once `max_connections`
are checked out; `BlockingConnectionPool` waits up to `pool_timeout_s` for one to be returned,
which is what a burst of requests wants.
"""

from __future__ import annotations

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff


def create_redis(url: str, *, max_connections: int = 64, pool_timeout_s: float = 5.0,
                 socket_timeout_s: float = 5.0, retries: int = 2) -> redis.Redis:
    """A client for `url` (redis://host:port/db) on a BlockingConnectionPool.

    redis-py retries a command `retries` times on connection errors (a short jittered backoff,
    capped at 0.25 s); callers that must not lose data (the usage journal) retry on their own
    above that, so this stays small and a dead Redis is reported within about a second.
    """
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.25), retries),
    )
    return redis.Redis(connection_pool=pool)
