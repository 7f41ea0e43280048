"""service/admission.py: places in flight, fair across tenants when they run out."""

import asyncio
from collections import Counter

import pytest

from service.admission import AdmissionTimeout, FairAdmission


def make(limit: int, wait_s: float, in_flight: Counter) -> FairAdmission:
    return FairAdmission(lambda: limit, lambda: Counter(in_flight), wait_s, poll_s=0.005)


def test_free_places_are_taken_at_once_and_given_back():
    async def main():
        in_flight = Counter()
        admission = make(4, 0.0, in_flight)
        await admission.reserve("a", 1.0, 3, {})
        assert admission.held() == {"a": 3}
        admission.release("a", 3)
        assert admission.held() == {} and admission.num_waited == 0
    asyncio.run(main())


def test_at_capacity_a_tenant_below_its_share_is_let_in_and_the_flooder_is_not():
    async def main():
        in_flight = Counter(a=4)  # a flooded every place
        admission = make(4, 0.0, in_flight)
        await admission.reserve("b", 1.0, 1, {"a": 1.0, "b": 1.0})  # share 2 of 4: in, past the limit
        assert admission.num_let_in_below_share == 1 and admission.held() == {"a": 4, "b": 1}
        with pytest.raises(AdmissionTimeout):
            await admission.reserve("a", 1.0, 1, {"a": 1.0, "b": 1.0})
        await admission.reserve("b", 1.0, 1, {})  # b's second: still within its share of 2
        with pytest.raises(AdmissionTimeout):
            await admission.reserve("b", 1.0, 1, {})  # a third would pass it
    asyncio.run(main())


def test_weights_set_the_share():
    async def main():
        in_flight = Counter(a=8)
        admission = make(8, 0.0, in_flight)
        for _ in range(6):  # weight 3 of 4: a share of 6 of the 8 places
            await admission.reserve("b", 3.0, 1, {"a": 1.0, "b": 3.0})
        with pytest.raises(AdmissionTimeout):
            await admission.reserve("b", 3.0, 1, {"a": 1.0, "b": 3.0})
    asyncio.run(main())


def test_a_freed_place_goes_to_the_waiting_tenant_holding_fewest_even_if_it_came_later():
    async def main():
        in_flight = Counter(a=2, b=2)  # full, each at its share
        admission = make(4, 5.0, in_flight)
        order = []

        async def ask(tenant):
            await admission.reserve(tenant, 1.0, 1, {"a": 1.0, "b": 1.0})
            order.append(tenant)

        first_b = asyncio.create_task(ask("b"))
        await asyncio.sleep(0.02)
        then_a = asyncio.create_task(ask("a"))
        await asyncio.sleep(0.02)
        assert order == [] and admission.num_waited == 2
        in_flight["a"] -= 1  # one of a's streams ends: a holds 1, b holds 2
        await asyncio.wait_for(then_a, 1.0)
        assert order == ["a"] and not first_b.done()
        in_flight["b"] -= 1
        await asyncio.wait_for(first_b, 1.0)
        assert order == ["a", "b"]
    asyncio.run(main())


def test_a_wait_ends_in_timeout_and_leaves_the_line():
    async def main():
        in_flight = Counter(a=2)
        admission = make(2, 0.05, in_flight)
        with pytest.raises(AdmissionTimeout):
            await admission.reserve("a", 1.0, 1, {})
        assert not admission._waiting and admission.held() == {"a": 2}
        in_flight["a"] = 0
        await admission.reserve("a", 1.0, 1, {})  # nobody waits now: straight in
    asyncio.run(main())


def test_a_newcomer_does_not_pass_the_line_for_a_free_place():
    async def main():
        in_flight = Counter(a=2)
        admission = make(2, 5.0, in_flight)
        waiter = asyncio.create_task(admission.reserve("a", 1.0, 1, {}))
        await asyncio.sleep(0.02)
        in_flight["a"] = 1  # a place frees: it is the waiter's, not a newcomer's of the same tenant
        with pytest.raises(AdmissionTimeout):
            admission.wait_s = 0
            await admission.reserve("a", 1.0, 1, {})
        await asyncio.wait_for(waiter, 1.0)
    asyncio.run(main())
