"""Per-tenant limits: requests and tokens per minute, concurrent requests. In process or in Redis.

Windows are fixed calendar minutes (window = floor(now / 60)): a tenant may use its whole
per-minute budget at the end of one minute and again at the start of the next. When a
per-minute limit is hit, Retry-After is the whole seconds until the window rolls over (1..60);
for the concurrency limit it is 1.

Tokens are counted in two steps: at arrival with an estimate from the body's size
(`acquire`), then up to prompt tokens + max_tokens once the body is tokenized (`extend`, which
can only refuse on tokens_per_minute); `release(lease, actual_tokens)` corrects the count by the
difference while the lease's minute is still the current one (service/request_lease.py drives
the three). A rejected acquire or extend counts nothing more. Checks run in the order requests_per_minute, tokens_per_minute, max_concurrent, and the
first one over is reported.

Redis keys (one Lua script checks and counts all three atomically):

    {prefix}ratelimit:{tenant}:window   hash {window, requests, tokens}; expires 120 s after use
    {prefix}ratelimit:{tenant}:leases   zset lease_id -> expiry (now + lease_ttl_s); the key
                                        expires lease_ttl_s after the latest acquire

A lease a dead replica never released stops counting after lease_ttl_s (default 10 minutes),
so a request running longer than that also stops counting against max_concurrent. Redis
windows use the Redis server's clock (TIME), so replicas agree; pass `clock` to use another.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

WINDOW_S = 60
LEASE_TTL_S = 600


class Limits(msgspec.Struct, frozen=True):
    """A tenant's limits; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None (unlimited), got {value!r}")

    @property
    def unlimited(self) -> bool:
        return self.requests_per_minute is None and self.tokens_per_minute is None and self.max_concurrent is None


class Lease(msgspec.Struct, frozen=True):
    """An admitted request: hand it back to `release` when the request ends."""

    tenant: str
    lease_id: str
    window: int  # the minute its request and tokens were counted in
    num_tokens: int  # tokens counted for tokens_per_minute
    holds_slot: bool  # False when the tenant had no limits (nothing was counted)


class RateLimitExceeded(Exception):
    """A tenant is over one of its limits; the service answers 429 with Retry-After."""

    def __init__(self, limit_name: str, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.limit_name = limit_name
        self.retry_after_s = retry_after_s
        self.message = message


class RateLimiter(Protocol):
    """Admission by tenant limits; both implementations share these semantics (see module doc)."""

    async def acquire(self, tenant: str, limits: Limits, num_tokens: int) -> Lease:
        """Count one request, `num_tokens` tokens and one slot; RateLimitExceeded if any limit is hit."""

    async def extend(self, lease: Lease, limits: Limits, num_tokens: int) -> Lease:
        """Count `num_tokens` more for the lease's request (in the current window); the lease with them.
        RateLimitExceeded (tokens_per_minute) if they do not fit, and then nothing more is counted."""

    async def release(self, lease: Lease, actual_tokens: int | None = None) -> None:
        """Free the lease's slot (once) and correct its token count to `actual_tokens`."""

    async def close(self) -> None:
        """Release what the limiter holds."""


def _exceeded(tenant: str, limit_name: str, limits: Limits, retry_after_s: int) -> RateLimitExceeded:
    value = getattr(limits, limit_name)
    return RateLimitExceeded(limit_name, retry_after_s, f"tenant {tenant} is over its {limit_name} limit ({value})")


def _check_tokens(num_tokens: int) -> None:
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")


def _unlimited_lease(tenant: str, num_tokens: int) -> Lease:
    return Lease(tenant, "", -1, num_tokens, holds_slot=False)


@dataclass
class _TenantUsage:
    window: int = -1
    num_requests: int = 0
    num_tokens: int = 0
    lease_ids: set[str] = field(default_factory=set)


class LocalRateLimiter:
    """Limits kept in this process (the embedded default); `clock` returns unix seconds."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._tenants: dict[str, _TenantUsage] = {}

    async def acquire(self, tenant: str, limits: Limits, num_tokens: int) -> Lease:
        """Count one request, `num_tokens` tokens and one slot; RateLimitExceeded if any limit is hit."""
        _check_tokens(num_tokens)
        if limits.unlimited:
            return _unlimited_lease(tenant, num_tokens)
        now = self._clock()
        window = int(now // WINDOW_S)
        usage = self._tenants.setdefault(tenant, _TenantUsage())
        if usage.window != window:
            usage.window, usage.num_requests, usage.num_tokens = window, 0, 0
        retry_after_s = max(1, math.ceil((window + 1) * WINDOW_S - now))
        if limits.requests_per_minute is not None and usage.num_requests + 1 > limits.requests_per_minute:
            raise _exceeded(tenant, "requests_per_minute", limits, retry_after_s)
        if limits.tokens_per_minute is not None and usage.num_tokens + num_tokens > limits.tokens_per_minute:
            raise _exceeded(tenant, "tokens_per_minute", limits, retry_after_s)
        if limits.max_concurrent is not None and len(usage.lease_ids) >= limits.max_concurrent:
            raise _exceeded(tenant, "max_concurrent", limits, 1)
        lease = Lease(tenant, secrets.token_hex(8), window, num_tokens, holds_slot=True)
        usage.num_requests += 1
        usage.num_tokens += num_tokens
        usage.lease_ids.add(lease.lease_id)
        return lease

    async def extend(self, lease: Lease, limits: Limits, num_tokens: int) -> Lease:
        """Count `num_tokens` more for the lease's request; RateLimitExceeded (tokens_per_minute) if over."""
        _check_tokens(num_tokens)
        usage = self._tenants.get(lease.tenant)
        if not lease.holds_slot or usage is None:
            return msgspec.structs.replace(lease, num_tokens=lease.num_tokens + num_tokens)
        now = self._clock()
        window = int(now // WINDOW_S)
        if usage.window != window:
            usage.window, usage.num_requests, usage.num_tokens = window, 0, 0
        if (limits.tokens_per_minute is not None and num_tokens > 0
                and usage.num_tokens + num_tokens > limits.tokens_per_minute):
            raise _exceeded(lease.tenant, "tokens_per_minute", limits, max(1, math.ceil((window + 1) * WINDOW_S - now)))
        usage.num_tokens += num_tokens
        counted = lease.num_tokens + num_tokens if window == lease.window else num_tokens  # this window's part
        return msgspec.structs.replace(lease, window=window, num_tokens=counted)

    async def release(self, lease: Lease, actual_tokens: int | None = None) -> None:
        """Free the lease's slot (once) and correct its token count to `actual_tokens`."""
        usage = self._tenants.get(lease.tenant)
        if not lease.holds_slot or usage is None or lease.lease_id not in usage.lease_ids:
            return
        usage.lease_ids.discard(lease.lease_id)
        if actual_tokens is not None and usage.window == lease.window:
            usage.num_tokens = max(0, usage.num_tokens + actual_tokens - lease.num_tokens)

    async def close(self) -> None:
        """Nothing to release."""


def _now_lua(argv_index: int) -> str:
    """Lua setting `now`: ARGV[argv_index] as unix seconds, or the Redis server's clock where it is ''."""
    return f"""
local now
if ARGV[{argv_index}] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[{argv_index}])
end"""


# KEYS: window hash, leases zset
# ARGV: rpm, tpm, max_concurrent (-1: none), num_tokens, lease_id, lease_ttl_s, now ('' = server TIME)
_ACQUIRE_LUA = _now_lua(7) + """
local window = math.floor(now / 60)
local retry = math.max(1, math.ceil((window + 1) * 60 - now))
local rpm, tpm, max_concurrent = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'window', 'requests', 'tokens')
local used_requests, used_tokens = 0, 0
if tonumber(state[1]) == window then
  used_requests = tonumber(state[2]) or 0
  used_tokens = tonumber(state[3]) or 0
end
if rpm >= 0 and used_requests + 1 > rpm then return {'requests_per_minute', retry, window} end
if tpm >= 0 and used_tokens + tonumber(ARGV[4]) > tpm then return {'tokens_per_minute', retry, window} end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if max_concurrent >= 0 and redis.call('ZCARD', KEYS[2]) >= max_concurrent then
  return {'max_concurrent', 1, window}
end
if tonumber(state[1]) ~= window then
  redis.call('HSET', KEYS[1], 'window', window, 'requests', 0, 'tokens', 0)
end
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[4])
redis.call('EXPIRE', KEYS[1], 120)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[6])
return {'', 0, window}
"""

# KEYS: window hash; ARGV: tpm (-1: none), num_tokens, now ('' = server TIME)
_EXTEND_LUA = _now_lua(3) + """
local window = math.floor(now / 60)
local tpm, num_tokens = tonumber(ARGV[1]), tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'window', 'tokens')
local used_tokens = 0
if tonumber(state[1]) == window then used_tokens = tonumber(state[2]) or 0 end
if tpm >= 0 and num_tokens > 0 and used_tokens + num_tokens > tpm then
  return {'tokens_per_minute', math.max(1, math.ceil((window + 1) * 60 - now)), window}
end
if tonumber(state[1]) ~= window then
  redis.call('HSET', KEYS[1], 'window', window, 'requests', 0, 'tokens', 0)
end
redis.call('HINCRBY', KEYS[1], 'tokens', num_tokens)
redis.call('EXPIRE', KEYS[1], 120)
return {'', 0, window}
"""

# KEYS: window hash, leases zset; ARGV: lease_id, window, token correction
_RELEASE_LUA = """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
if tonumber(ARGV[3]) ~= 0 and redis.call('HGET', KEYS[1], 'window') == ARGV[2] then
  if redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[3]) < 0 then redis.call('HSET', KEYS[1], 'tokens', 0) end
end
return 1
"""


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisRateLimiter:
    """Limits shared by every replica using the same Redis and key prefix (see module doc)."""

    def __init__(self, redis_client, key_prefix: str = "pagedserve:", *, lease_ttl_s: int = LEASE_TTL_S,
                 clock: Callable[[], float] | None = None, close_client: bool = False) -> None:
        self._redis = redis_client
        self._prefix = key_prefix
        self._lease_ttl_s = int(lease_ttl_s)
        self._clock = clock
        self._close_client = close_client
        self._acquire_script = redis_client.register_script(_ACQUIRE_LUA)
        self._release_script = redis_client.register_script(_RELEASE_LUA)
        self._extend_script = redis_client.register_script(_EXTEND_LUA)

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self._prefix}ratelimit:{tenant}"
        return [f"{base}:window", f"{base}:leases"]

    async def acquire(self, tenant: str, limits: Limits, num_tokens: int) -> Lease:
        """Count one request, `num_tokens` tokens and one slot; RateLimitExceeded if any limit is hit."""
        _check_tokens(num_tokens)
        if limits.unlimited:
            return _unlimited_lease(tenant, num_tokens)
        lease_id = secrets.token_hex(8)
        args = [-1 if value is None else value
                for value in (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent)]
        now = "" if self._clock is None else repr(float(self._clock()))
        limit_name, retry_after_s, window = await self._acquire_script(
            keys=self._keys(tenant), args=[*args, num_tokens, lease_id, self._lease_ttl_s, now])
        limit_name = _str(limit_name)
        if limit_name:
            raise _exceeded(tenant, limit_name, limits, int(retry_after_s))
        return Lease(tenant, lease_id, int(window), num_tokens, holds_slot=True)

    async def extend(self, lease: Lease, limits: Limits, num_tokens: int) -> Lease:
        """Count `num_tokens` more for the lease's request; RateLimitExceeded (tokens_per_minute) if over."""
        _check_tokens(num_tokens)
        if not lease.holds_slot:
            return msgspec.structs.replace(lease, num_tokens=lease.num_tokens + num_tokens)
        tpm = -1 if limits.tokens_per_minute is None else limits.tokens_per_minute
        now = "" if self._clock is None else repr(float(self._clock()))
        limit_name, retry_after_s, window = await self._extend_script(keys=self._keys(lease.tenant)[:1],
                                                                      args=[tpm, num_tokens, now])
        if _str(limit_name):
            raise _exceeded(lease.tenant, "tokens_per_minute", limits, int(retry_after_s))
        window = int(window)
        counted = lease.num_tokens + num_tokens if window == lease.window else num_tokens  # this window's part
        return msgspec.structs.replace(lease, window=window, num_tokens=counted)

    async def release(self, lease: Lease, actual_tokens: int | None = None) -> None:
        """Free the lease's slot (once) and correct its token count to `actual_tokens`."""
        if not lease.holds_slot:
            return
        correction = 0 if actual_tokens is None else actual_tokens - lease.num_tokens
        await self._release_script(keys=self._keys(lease.tenant), args=[lease.lease_id, lease.window, correction])

    async def close(self) -> None:
        """Close the Redis client if this limiter owns it."""
        if self._close_client:
            await self._redis.aclose()
