"""An API request's claim on its tenant's limits, taken when it arrives, before any work on its body.

    arrive   take:    one request, the body's bytes / 16 as tokens, one concurrency slot   (else 429)
    tokenize extend:  up to prompt + n * max_tokens, once they are known (Generation.admit) (else 429)
    end      release: corrected to the tokens used; a request refused before it was tokenized keeps
                      its estimate (the work of reading it was done)

So /tokenize, /detokenize, count_tokens and requests refused in validation count against
requests_per_minute, tokens_per_minute and max_concurrent like any other. A Generation takes the
lease over (`hand_over`) and releases it when it is billed; otherwise the handler's `async with`
releases it. Limits fail open: with the limiter unreachable (Redis down) the request goes on unleased.
"""

from __future__ import annotations

import asyncio

import structlog
from redis.exceptions import RedisError

from service.errors import APIError
from service.preprocessing import estimated_tokens, request_bytes
from service.rate_limit import Lease, RateLimitExceeded
from service.tenants import Tenant

log = structlog.get_logger(__name__)


def _too_many(exc: RateLimitExceeded) -> APIError:
    return APIError(429, exc.message, None, "rate_limit_exceeded", {"Retry-After": str(exc.retry_after_s)})


class RequestLease:
    """`async with RequestLease(state, tenant, num_bytes) as lease:` around a request's handling."""

    def __init__(self, state, tenant: Tenant, num_bytes: int) -> None:
        self.state = state
        self.tenant = tenant
        self.num_bytes = num_bytes
        self.num_estimated_tokens = estimated_tokens(num_bytes)
        self.lease: Lease | None = None  # None: unleased (limiter down), or handed over
        self.used_tokens: int | None = None  # set by the handler once known: the release corrects to it

    async def __aenter__(self) -> RequestLease:
        acquire = asyncio.ensure_future(self.state.limiter.acquire(self.tenant.tenant_id, self.tenant.limits,
                                                                   self.num_estimated_tokens))
        try:
            self.lease = await asyncio.shield(acquire)
        except asyncio.CancelledError:  # the caller left while the limiter answered: give the lease back
            acquire.add_done_callback(self._release_orphan)
            raise
        except RateLimitExceeded as exc:
            raise _too_many(exc) from exc
        except (OSError, RedisError) as exc:  # limits fail open: serving must not stop with Redis
            log.warning("rate limiter unreachable; admitting", error=str(exc), tenant=self.tenant.tenant_id)
        self._bytes_token = request_bytes.set(self.num_bytes)  # how its preprocessing is scheduled
        return self

    async def __aexit__(self, *exc_info) -> None:
        request_bytes.reset(self._bytes_token)
        if self.lease is not None:
            self.state.spawn(self._release(self.lease, self.used_tokens))
            self.lease = None

    async def extend_to(self, num_tokens: int) -> None:
        """Count the request's tokens up to `num_tokens` (never down): 429 if they do not fit the minute."""
        if self.lease is None or num_tokens <= self.lease.num_tokens:
            return
        try:
            self.lease = await self.state.limiter.extend(self.lease, self.tenant.limits, num_tokens - self.lease.num_tokens)
        except RateLimitExceeded as exc:
            raise _too_many(exc) from exc
        except (OSError, RedisError) as exc:
            log.warning("rate limiter unreachable; admitting", error=str(exc), tenant=self.tenant.tenant_id)

    def hand_over(self) -> Lease | None:
        """The lease, now the caller's to release (a Generation's, at its end); the `async with` leaves it be."""
        lease, self.lease = self.lease, None
        return lease

    def _release_orphan(self, acquire: asyncio.Future) -> None:
        if not acquire.cancelled() and acquire.exception() is None:
            self.state.spawn(self._release(acquire.result(), None))

    async def _release(self, lease: Lease, used_tokens: int | None) -> None:
        try:
            await self.state.limiter.release(lease, used_tokens)
        except (OSError, RedisError) as exc:
            log.warning("rate limiter unreachable; lease not released", error=str(exc), tenant=lease.tenant)
