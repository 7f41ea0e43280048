"""service/rate_limit.py: per-minute and concurrency limits, in process and shared through Redis."""

import asyncio
import math
import time
import uuid
from contextlib import asynccontextmanager

import pytest

from service.rate_limit import Limits, LocalRateLimiter, RateLimitExceeded, RedisRateLimiter
from service.redis_pool import create_redis
from tests.service.redis_fixture import redis_server, redis_url  # noqa: F401

BACKENDS = ["local", "redis"]


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def open_limiter(kind: str, url: str, clock=None, prefix: str = "rl:", **kwargs):
    if kind == "local":
        limiter = LocalRateLimiter(clock)
    else:
        limiter = RedisRateLimiter(create_redis(url), prefix, clock=clock, close_client=True, **kwargs)
    try:
        yield limiter
    finally:
        await limiter.close()


async def refused(limiter, tenant, limits, num_tokens=0) -> tuple[str, int, str]:
    with pytest.raises(RateLimitExceeded) as info:
        await limiter.acquire(tenant, limits, num_tokens)
    return info.value.limit_name, info.value.retry_after_s, info.value.message


@pytest.mark.parametrize("kind", BACKENDS)
def test_requests_per_minute_refuses_until_the_window_rolls_over(kind, redis_url):
    clock = Clock(100.0)  # window [60, 120)
    limits = Limits(requests_per_minute=3)

    async def main():
        async with open_limiter(kind, redis_url, clock) as limiter:
            for _ in range(3):
                await limiter.acquire("acme", limits, 0)
            first = await refused(limiter, "acme", limits)
            clock.now = 119.5
            last_moment = await refused(limiter, "acme", limits)
            clock.now = 120.0
            lease = await limiter.acquire("acme", limits, 0)
            return first, last_moment, lease.window

    first, last_moment, window = asyncio.run(main())
    assert first == ("requests_per_minute", 20, "tenant acme is over its requests_per_minute limit (3)")
    assert last_moment[1] == 1
    assert window == 2


@pytest.mark.parametrize("kind", BACKENDS)
def test_retry_after_is_a_full_minute_at_the_start_of_a_window(kind, redis_url):
    clock = Clock(180.0)

    async def main():
        async with open_limiter(kind, redis_url, clock) as limiter:
            await limiter.acquire("acme", Limits(requests_per_minute=1), 0)
            return await refused(limiter, "acme", Limits(requests_per_minute=1))

    assert asyncio.run(main())[1] == 60


@pytest.mark.parametrize("kind", BACKENDS)
def test_tokens_per_minute_counts_the_estimate_and_release_corrects_it(kind, redis_url):
    clock = Clock(1_000_000.0)
    limits = Limits(tokens_per_minute=1000)

    async def main():
        async with open_limiter(kind, redis_url, clock) as limiter:
            lease = await limiter.acquire("acme", limits, 600)
            over = await refused(limiter, "acme", limits, 500)
            await limiter.release(lease, actual_tokens=100)
            await limiter.release(lease, actual_tokens=0)  # a second release changes nothing
            await limiter.acquire("acme", limits, 500)
            over_by_one = await refused(limiter, "acme", limits, 401)
            await limiter.acquire("acme", limits, 400)
            return over, over_by_one

    over, over_by_one = asyncio.run(main())
    assert over == ("tokens_per_minute", 20, "tenant acme is over its tokens_per_minute limit (1000)")
    assert over_by_one[0] == "tokens_per_minute"


@pytest.mark.parametrize("kind", BACKENDS)
def test_extend_counts_more_tokens_and_refuses_past_the_minute(kind, redis_url):
    clock = Clock(1_000_000.0)
    limits = Limits(tokens_per_minute=1000)

    async def main():
        async with open_limiter(kind, redis_url, clock) as limiter:
            lease = await limiter.acquire("acme", limits, 100)  # the body's estimate
            lease = await limiter.extend(lease, limits, 500)  # its prompt and max_tokens, once known
            with pytest.raises(RateLimitExceeded) as too_much:
                await limiter.extend(lease, limits, 401)  # 100 + 500 + 401 > 1000: nothing is counted
            over = await refused(limiter, "acme", limits, 401)
            await limiter.acquire("acme", limits, 400)
            await limiter.release(lease, actual_tokens=50)  # corrects the extended count, 600, to 50
            await limiter.acquire("acme", limits, 550)
            full = await refused(limiter, "acme", limits, 1)
            return lease.num_tokens, too_much.value.limit_name, over[0], full[0]

    assert asyncio.run(main()) == (600, "tokens_per_minute", "tokens_per_minute", "tokens_per_minute")


@pytest.mark.parametrize("kind", BACKENDS)
def test_extend_in_a_new_minute_counts_there_only(kind, redis_url):
    clock = Clock(100.0)
    limits = Limits(tokens_per_minute=1000)

    async def main():
        async with open_limiter(kind, redis_url, clock) as limiter:
            lease = await limiter.acquire("acme", limits, 900)
            clock.now = 125.0
            lease = await limiter.extend(lease, limits, 300)
            await limiter.release(lease, actual_tokens=0)  # frees the 300 of this minute, not 1200
            await limiter.acquire("acme", limits, 1000)
            return lease.window, lease.num_tokens, await refused(limiter, "acme", limits, 1)

    window, num_tokens, full = asyncio.run(main())
    assert (window, num_tokens, full[0]) == (2, 300, "tokens_per_minute")


@pytest.mark.parametrize("kind", BACKENDS)
def test_token_correction_after_the_window_rolled_over_is_ignored(kind, redis_url):
    clock = Clock(100.0)
    limits = Limits(tokens_per_minute=1000)

    async def main():
        async with open_limiter(kind, redis_url, clock) as limiter:
            lease = await limiter.acquire("acme", limits, 900)
            clock.now = 130.0
            await limiter.acquire("acme", limits, 1000)
            await limiter.release(lease, actual_tokens=0)  # would free 900 of the new window's tokens
            return await refused(limiter, "acme", limits, 1)

    assert asyncio.run(main())[:2] == ("tokens_per_minute", 50)


@pytest.mark.parametrize("kind", BACKENDS)
def test_max_concurrent_frees_one_slot_per_lease_released(kind, redis_url):
    clock = Clock(100.0)
    limits = Limits(max_concurrent=2)

    async def main():
        async with open_limiter(kind, redis_url, clock) as limiter:
            first = await limiter.acquire("acme", limits, 10)
            await limiter.acquire("acme", limits, 10)
            full = await refused(limiter, "acme", limits)
            other_tenant = await limiter.acquire("globex", limits, 10)
            await limiter.release(first)
            await limiter.release(first)
            await limiter.acquire("acme", limits, 10)
            return full, await refused(limiter, "acme", limits), other_tenant.holds_slot

    full, still_full, other_tenant_admitted = asyncio.run(main())
    assert full == ("max_concurrent", 1, "tenant acme is over its max_concurrent limit (2)")
    assert still_full[0] == "max_concurrent"
    assert other_tenant_admitted


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_refused_request_counts_nothing(kind, redis_url):
    clock = Clock(100.0)
    limits = Limits(requests_per_minute=1, tokens_per_minute=100, max_concurrent=1)

    async def main():
        async with open_limiter(kind, redis_url, clock) as limiter:
            too_big = await refused(limiter, "acme", limits, 200)
            lease = await limiter.acquire("acme", limits, 100)
            return too_big[0], lease.num_tokens

    assert asyncio.run(main()) == ("tokens_per_minute", 100)


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_tenant_without_limits_is_never_counted(kind, redis_url):
    async def main():
        async with open_limiter(kind, redis_url, Clock(100.0)) as limiter:
            leases = [await limiter.acquire("acme", Limits(), 10**9) for _ in range(200)]
            for lease in leases:
                await limiter.release(lease, 5)
            return leases[0]

    lease = asyncio.run(main())
    assert (lease.holds_slot, lease.num_tokens) == (False, 10**9)


def test_two_redis_replicas_share_limits(redis_url):
    clock = Clock(100.0)
    rpm, slots = Limits(requests_per_minute=2), Limits(max_concurrent=1)

    async def main():
        async with open_limiter("redis", redis_url, clock) as a, open_limiter("redis", redis_url, clock) as b:
            await a.acquire("acme", rpm, 0)
            await b.acquire("acme", rpm, 0)
            over_rpm = await refused(a, "acme", rpm)
            held = await a.acquire("globex", slots, 0)
            over_slots = await refused(b, "globex", slots)
            await a.release(held)
            admitted = await b.acquire("globex", slots, 0)
            return over_rpm[0], over_slots[0], admitted.holds_slot

    assert asyncio.run(main()) == ("requests_per_minute", "max_concurrent", True)


def test_redis_admits_exactly_max_concurrent_of_simultaneous_acquires(redis_url):
    limits = Limits(max_concurrent=5, requests_per_minute=1000)

    async def main():
        async with open_limiter("redis", redis_url) as limiter:
            return await asyncio.gather(*(limiter.acquire("acme", limits, 1) for _ in range(20)),
                                        return_exceptions=True)

    results = asyncio.run(main())
    assert sum(not isinstance(r, Exception) for r in results) == 5
    assert {r.limit_name for r in results if isinstance(r, RateLimitExceeded)} == {"max_concurrent"}


def test_redis_slots_of_a_dead_replica_expire_after_the_lease_ttl(redis_url):
    clock = Clock(1_000.0)
    limits = Limits(max_concurrent=1)

    async def main():
        async with open_limiter("redis", redis_url, clock, lease_ttl_s=600) as dead, \
                open_limiter("redis", redis_url, clock, lease_ttl_s=600) as alive:
            await dead.acquire("acme", limits, 0)  # never released
            clock.now = 1_599.0
            before = await refused(alive, "acme", limits)
            clock.now = 1_600.5
            lease = await alive.acquire("acme", limits, 0)
            return before[0], lease.holds_slot

    assert asyncio.run(main()) == ("max_concurrent", True)


def test_redis_windows_follow_the_server_clock_without_an_injected_one(redis_url):
    limits = Limits(requests_per_minute=1)

    async def main():
        async with open_limiter("redis", redis_url, prefix=f"rl-{uuid.uuid4().hex}:") as limiter:
            client = create_redis(redis_url)
            seconds, _ = await client.time()
            if seconds % 60 >= 58:  # keep the two acquires in one window
                await asyncio.sleep(61 - seconds % 60)
            before, _ = await client.time()
            await limiter.acquire("acme", limits, 0)
            name, retry_after_s, _ = await refused(limiter, "acme", limits)
            after, _ = await client.time()
            await client.aclose()
            return name, retry_after_s, {60 - before % 60, 60 - after % 60}

    name, retry_after_s, allowed = asyncio.run(main())
    assert name == "requests_per_minute" and retry_after_s in allowed


def test_local_limiter_defaults_to_the_wall_clock():
    async def main():
        limiter = LocalRateLimiter()
        if time.time() % 60 > 59.5:  # keep the two acquires in one window
            await asyncio.sleep(0.6)
        await limiter.acquire("acme", Limits(requests_per_minute=1), 0)
        before = time.time()
        name, retry_after_s, _ = await refused(limiter, "acme", Limits(requests_per_minute=1))
        return name, retry_after_s, {max(1, math.ceil(60 - t % 60)) for t in (before, time.time())}

    name, retry_after_s, allowed = asyncio.run(main())
    assert name == "requests_per_minute" and retry_after_s in allowed


def test_limits_refuse_negative_values():
    with pytest.raises(ValueError, match=r"tokens_per_minute must be an int >= 0 or None \(unlimited\), got -1"):
        Limits(tokens_per_minute=-1)
