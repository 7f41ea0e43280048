"""Admission: places for sequences in flight, handed out fairly across tenants when they run out.

The server (or, behind Dynamo, the front door for the whole cluster) takes at most `limit`
sequences in flight: the engines' seats plus their queues. While places are free a request
takes its places at once. When they run out:

  - a tenant holding less than its weighted share of the places (the share among the tenants
    holding or waiting for places) is let in anyway: a tenant that floods cannot keep the
    others out (at most `limit` more in flight, one share each), and the engines' fair
    schedulers (runtime/fairness.py) then start it ahead of the flood;
  - anyone else waits, up to `wait_s`, in a line that serves the waiting tenant holding the
    fewest places per weight first (arrival order within it and among equals); past `wait_s`
    it gets a 429.

Waiters look again every `poll_s` and whenever a place is given back here, so a place freed
anywhere (a stream finishing on the bridge) is taken within poll_s.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable


class AdmissionTimeout(Exception):
    """No place came free within the wait."""


class FairAdmission:
    """Places in flight per tenant; `in_flight()` counts what the bridge holds (by tenant), this adds the reserved."""

    def __init__(self, limit: Callable[[], int], in_flight: Callable[[], Counter[str]], wait_s: float,
                 poll_s: float = 0.01) -> None:
        self._limit = limit
        self._in_flight = in_flight
        self.wait_s = wait_s
        self._poll_s = poll_s
        self.reserved: Counter[str] = Counter()  # places taken and not yet handed to the bridge
        self._waiting: dict[int, tuple[str, float, int]] = {}  # ticket -> (tenant, weight, places)
        self._tickets = itertools.count()
        self._changed = asyncio.Event()
        self.num_waited = 0  # requests that had to wait for a place
        self.num_let_in_below_share = 0  # let in past the limit or the line: their tenant was below its share

    def held(self) -> Counter[str]:
        """Places each tenant holds: in flight on the bridge plus reserved here."""
        held = self._in_flight()
        held.update(self.reserved)
        return held

    def _share(self, tenant: str, weight: float, held: Counter[str], weights: dict[str, float]) -> float:
        active = {t for t, n in held.items() if n > 0} | {t for t, _, _ in self._waiting.values()} | {tenant}
        weights = {**weights, tenant: weight}
        return self._limit() * weight / sum(weights.get(t, 1.0) for t in active)

    def _try(self, ticket: int | None, tenant: str, weight: float, num: int, weights: dict[str, float]) -> bool:
        held = self.held()
        if sum(held.values()) + num <= self._limit() and self._is_next(ticket, held, weights):
            return True
        ahead = any(t == tenant and (ticket is None or other < ticket) for other, (t, _, _) in self._waiting.items())
        if not ahead and held[tenant] + num <= self._share(tenant, weight, held, weights):
            self.num_let_in_below_share += 1  # (its own earlier requests, if any wait, go first)
            return True
        return False

    def _is_next(self, ticket: int | None, held: Counter[str], weights: dict[str, float]) -> bool:
        """A newcomer (ticket None) goes only if nobody waits; a waiter only if it is the line's head."""
        if not self._waiting:
            return ticket is None
        head = min(self._waiting, key=lambda t: (held[self._waiting[t][0]] / self._waiting[t][1], t))
        return ticket == head

    async def reserve(self, tenant: str, weight: float, num: int, weights: dict[str, float]) -> None:
        """Take `num` places for `tenant` (plan weight `weight`; `weights`: other tenants' weights by id), waiting
        for them if it must; AdmissionTimeout after wait_s."""
        if not self._try(None, tenant, weight, num, weights):
            if self.wait_s <= 0:
                raise AdmissionTimeout()
            await self._wait(tenant, weight, num, weights)
        self.reserved[tenant] += num

    async def _wait(self, tenant: str, weight: float, num: int, weights: dict[str, float]) -> None:
        ticket = next(self._tickets)
        self._waiting[ticket] = (tenant, weight, num)
        self.num_waited += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise AdmissionTimeout()
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), min(self._poll_s, left))
                except TimeoutError:
                    pass
                if self._try(ticket, tenant, weight, num, weights):
                    return
        finally:
            del self._waiting[ticket]
            self._changed.set()  # the next in line looks again at once

    def release(self, tenant: str, num: int) -> None:
        """Give back reserved places (the request was handed to the bridge, which counts it now, or it failed)."""
        self.reserved[tenant] -= num
        if self.reserved[tenant] <= 0:
            del self.reserved[tenant]
        self._changed.set()
