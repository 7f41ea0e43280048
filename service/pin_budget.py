"""Each tenant's share of the pinned pages: one tenant's pins cannot take the pages another's need.

The engine holds pins within one pool budget (engine.pinned_block_budget, at most a quarter
of the pages). Inside it, each tenant may hold at most its plan's `pinned_pages`, or, where the
plan says nothing, an equal share: the pool budget // the number of tenants (at least one page).
A pin's pages are counted as the engine counts them: its full pages (prompt tokens // page size).

    reserve(tenant, pin_id, num_pages)   before the prefill: 400 pin_budget_exceeded past the share
                                         (re-pinning an id replaces its pages, so they are not counted twice)
    release(tenant, pin_id)              the pin was removed, or its prefill failed

Counts live in this process, for the pins this server placed (restored ones included).
"""

from __future__ import annotations

from service.errors import APIError
from service.tenants import Tenant


class PinBudget:
    """Pages held by each tenant's pins, against each tenant's share."""

    def __init__(self, pool_pages: int, num_tenants: int) -> None:
        if pool_pages < 0 or num_tenants < 1:
            raise ValueError(f"pool_pages must be >= 0 and num_tenants >= 1, got {pool_pages}, {num_tenants}")
        self.pool_pages = pool_pages
        self.default_share = max(1, pool_pages // num_tenants)
        self._held: dict[str, dict[str, int]] = {}  # tenant -> pin id -> pages

    def share(self, tenant: Tenant) -> int:
        """The pages `tenant`'s pins may hold in all."""
        return self.default_share if tenant.pinned_pages is None else tenant.pinned_pages

    def held(self, tenant_id: str) -> int:
        return sum(self._held.get(tenant_id, {}).values())

    def reserve(self, tenant: Tenant, pin_id: str, num_pages: int) -> None:
        """Count `num_pages` for the pin (replacing what it held); APIError 400 if the tenant's share is passed."""
        pins = self._held.setdefault(tenant.tenant_id, {})
        others = sum(pages for other, pages in pins.items() if other != pin_id)
        share = self.share(tenant)
        if others + num_pages > share:
            raise APIError(400, f"pinning {num_pages} pages would pass your pin budget of {share} pages "
                                f"({others} held by your other pins)", "text", "pin_budget_exceeded")
        pins[pin_id] = num_pages

    def release(self, tenant_id: str, pin_id: str) -> None:
        pins = self._held.get(tenant_id)
        if pins is not None:
            pins.pop(pin_id, None)
            if not pins:
                del self._held[tenant_id]
