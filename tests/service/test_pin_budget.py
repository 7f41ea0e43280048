"""service/pin_budget.py: each tenant's pins within its share of the pinned pages."""

import pytest

from service.errors import APIError
from service.pin_budget import PinBudget
from service.tenants import FREE, Tenant


def test_a_tenant_is_held_to_its_share_and_the_others_keep_theirs():
    budget = PinBudget(pool_pages=64, num_tenants=4)  # 16 pages each unless the plan says
    acme, globex, big = Tenant("acme", FREE), Tenant("globex", FREE), Tenant("big", FREE, pinned_pages=40)
    budget.reserve(acme, "sys", 12)
    with pytest.raises(APIError) as over:
        budget.reserve(acme, "faq", 5)
    budget.reserve(globex, "sys", 16)  # acme at its share takes nothing of globex's
    budget.reserve(big, "sys", 40)
    assert over.value.status == 400 and over.value.code == "pin_budget_exceeded" and over.value.param == "text"
    assert (budget.held("acme"), budget.held("globex"), budget.held("big")) == (12, 16, 40)


def test_re_pinning_an_id_replaces_its_pages_and_release_frees_them():
    budget = PinBudget(pool_pages=32, num_tenants=2)
    acme = Tenant("acme", FREE)
    budget.reserve(acme, "sys", 10)
    budget.reserve(acme, "sys", 16)  # the same pin, bigger: 16, not 26
    budget.release("acme", "sys")
    budget.release("acme", "never")  # nothing to free: no error
    budget.reserve(acme, "faq", 16)
    assert budget.held("acme") == 16


def test_a_share_is_at_least_one_page():
    assert PinBudget(pool_pages=2, num_tenants=5).share(Tenant("acme", FREE)) == 1
    with pytest.raises(ValueError):
        PinBudget(pool_pages=-1, num_tenants=1)
