"""Scheduling policies: the scheduler's decisions about tenants, as objects registered by name.

runtime/scheduler.py owns the mechanism (the token budget, pages, preemption, forks); a
policy answers what the mechanism asks, at these points of a step:

    __init__            new_queue           the waiting queue the policy orders
    add(seq)            on_arrival          a tenant back from idle may be lifted (fair)
    schedule(), phase 1 room_victim         one sequence to preempt so a tenant below its share starts (fair)
    (make_room)
    schedule()          prompt_budget       the prompt tokens a step may compute beside its decodes
                        light_tenants       who starts before the other tenants' prompt chunks (fair)
    both                first_tenants       who the queue takes first, each with the part of its share it holds
    preemption          pick_victim         whose pages go back when the pool runs out

    SCHEDULING_POLICIES = {"fcfs": FcfsPolicy, "fair": FairPolicy}   (engine.scheduling)

FcfsPolicy is arrival order: one line, no tenants. FairPolicy is the Virtual Token Counter
(runtime/fairness.py: the counters and the queue, and why each rule is there).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from runtime.fairness import NO_TENANT_FIRST, FairQueue, FcfsQueue, VirtualTokenCounters
from runtime.request import Sequence

if TYPE_CHECKING:
    from runtime.scheduler import Scheduler


class SchedulingPolicy(Protocol):
    """What the scheduler asks of a policy. It reads the scheduler's state and changes none of it but the tenants'
    counters (a lift on arrival); the scheduler moves sequences and pages."""

    name: str
    by_tenant: bool  # decisions depend on tenants: the scheduler counts their seats and runs the light pass

    def new_queue(self) -> FcfsQueue | FairQueue: ...

    def on_arrival(self, sched: Scheduler, seq: Sequence) -> None: ...

    def prompt_budget(self, sched: Scheduler, budget: int) -> int: ...

    def first_tenants(self, sched: Scheduler, seats: Counter[str]) -> Mapping[str, float]: ...

    def light_tenants(self, sched: Scheduler, seats: Counter[str], chunk_tenants: set[str]) -> Mapping[str, float]: ...

    def room_victim(self, sched: Scheduler) -> Sequence | None: ...

    def pick_victim(self, sched: Scheduler, candidates: list[Sequence]) -> Sequence: ...


class FcfsPolicy:
    """First come first served: one line in arrival order, tenants ignored; the newest running sequence gives
    its pages back first."""

    name = "fcfs"
    by_tenant = False

    def __init__(self, counters: VirtualTokenCounters, fair_prompt_tokens: int = 0) -> None:
        pass  # every policy is made from the same arguments; arrival order needs neither

    def new_queue(self) -> FcfsQueue:
        return FcfsQueue()

    def on_arrival(self, sched: Scheduler, seq: Sequence) -> None:
        pass

    def prompt_budget(self, sched: Scheduler, budget: int) -> int:
        return budget

    def first_tenants(self, sched: Scheduler, seats: Counter[str]) -> Mapping[str, float]:
        return NO_TENANT_FIRST

    def light_tenants(self, sched: Scheduler, seats: Counter[str], chunk_tenants: set[str]) -> Mapping[str, float]:
        return NO_TENANT_FIRST

    def room_victim(self, sched: Scheduler) -> Sequence | None:
        return None

    def pick_victim(self, sched: Scheduler, candidates: list[Sequence]) -> Sequence:
        """`candidates` newest first."""
        return candidates[0]


class FairPolicy:
    """Fair across tenants by virtual token counters (runtime/fairness.py), with shares of seats weighted by the
    tenants' plans."""

    name = "fair"
    by_tenant = True

    def __init__(self, counters: VirtualTokenCounters, fair_prompt_tokens: int = 0) -> None:
        self.counters = counters
        self.fair_prompt_tokens = fair_prompt_tokens  # with tenants sharing: prompt tokens a step (0: no cap)

    def new_queue(self) -> FairQueue:
        return FairQueue(self.counters)

    def on_arrival(self, sched: Scheduler, seq: Sequence) -> None:
        """A tenant with nothing waiting is lifted to the floor of the tenants that have (or, if none has, of
        those running): waiting banks no credit."""
        tenant = seq.request.tenant
        if not sched.waiting.depth(tenant):
            self.counters.lift(tenant, sched.waiting.tenants() or sched.seats_by_tenant())

    def prompt_budget(self, sched: Scheduler, budget: int) -> int:
        """While more than one tenant is active, at most fair_prompt_tokens of prompt work a step: the step running
        when a light tenant arrives is short."""
        if 0 < self.fair_prompt_tokens < budget and self._tenants_share(sched):
            return self.fair_prompt_tokens
        return budget

    def share(self, sched: Scheduler, tenant: str, active: set[str]) -> float:
        """The tenant's weighted share of max_num_seqs among the active tenants."""
        weights = self.counters.weights
        return sched.max_num_seqs * weights[tenant] / sum(weights[t] for t in active | {tenant})

    def first_tenants(self, sched: Scheduler, seats: Counter[str]) -> Mapping[str, float]:
        """Waiting tenants that could start one more sequence and stay within their share of seats, each with
        the part of its share it holds (the queue's tie-break: of two tenants level on counters, the one
        further below its share starts first)."""
        waiting = sched.waiting.tenants()
        active = self._active_tenants(sched, seats)
        shares = {t: self.share(sched, t, active) for t in waiting}
        return {t: seats[t] / share for t, share in shares.items() if seats[t] + 1 <= share}

    def light_tenants(self, sched: Scheduler, seats: Counter[str], chunk_tenants: set[str]) -> Mapping[str, float]:
        """The tenants that start before the prompt chunks of `chunk_tenants`: below their share of seats, not
        among them, and with a counter no larger than theirs (each start is charged at once, so a tenant goes
        first only while it is behind: it never starves the others' prompts; a tolerance of one step's budget
        did, measured). The floor is read on each call, and holds through one admission round: the queue
        takes only tenants given here, none of them among `chunk_tenants`, so no chunk tenant is charged."""
        counters = self.counters.counters
        chunks_floor = min((counters[t] for t in chunk_tenants), default=0.0)
        return {t: held for t, held in self.first_tenants(sched, seats).items()
                if t not in chunk_tenants and counters[t] <= chunks_floor}

    def room_victim(self, sched: Scheduler) -> Sequence | None:
        """One sequence of the tenant furthest ahead to preempt if the next waiting sequence cannot start
        otherwise (its first chunk's pages counted after those this step's decodes take).

        Only where the waiting tenant stays within its share of seats by starting, and the victim
        tenant keeps at least its own share of seats or of the pool's pages: two backlogged tenants
        never take seats or pages back and forth (shares need not be whole numbers). Of the tenants
        that qualify, the one furthest ahead on counters gives. Pages count because they bind first
        when prompts are long: a flood of 640-token requests fills the pool with fewer sequences than
        its share of seats, and a light tenant then waited for one of them to finish (traced through
        the server, issue 36). Counters do not gate it: a light tenant is lifted to the flood's
        counter on arrival and charged its prompt at once, so it sits level with the flood or a few
        tokens ahead, and while the flood's sequences were recomputed (not charged) the light
        tenant's requirement of a smaller counter kept it out for steps (traced). The victim is that
        tenant's latest-arrived running request, so a request already preempted once (it keeps its
        place in arrival order) is not the next one taken again.
        """
        if not sched.waiting:
            return None
        seats = sched.seats_by_tenant()
        head = sched.waiting.peek(self.first_tenants(sched, seats))
        tenant = head.request.tenant
        needed = sched.num_seats(head)
        kv = sched.kv
        if sum(seats.values()) + needed <= sched.max_num_seqs:
            cached, first_chunk = sched.first_chunk(head, max(1, sched.max_num_batched_tokens - len(sched.running)))
            decode_pages = sum(1 for s in sched.running
                               if s.num_tokens - s.num_computed_tokens == 1 and not kv.has_room(s, 1))
            if kv.can_allocate(head, first_chunk, cached, reserve=decode_pages):
                return None  # it starts this step without anyone's seat
        active = self._active_tenants(sched, seats)
        if seats[tenant] + needed > self.share(sched, tenant, active):
            return None
        counters = self.counters.counters
        pages: Counter[str] = Counter()
        for seq in sched.running:
            pages[seq.request.tenant] += len(kv.block_ids(seq))
        victims = {}
        for t, held in seats.items():
            if t == tenant:
                continue
            victim = max((s for s in sched.running if s.request.tenant == t and not s.request.fork_pending),
                         key=lambda s: s.request.arrival_order, default=None)
            if victim is None:
                continue
            share = self.share(sched, t, active)
            page_share = kv.pool.num_blocks * share / sched.max_num_seqs
            if held - 1 >= share or pages[t] - len(kv.block_ids(victim)) >= page_share:
                victims[t] = victim
        if not victims:
            return None
        return victims[max(victims, key=lambda t: counters[t])]

    def pick_victim(self, sched: Scheduler, candidates: list[Sequence]) -> Sequence:
        """The furthest-ahead tenant's newest (`candidates` newest first)."""
        counters = self.counters.counters
        return max(candidates, key=lambda s: (counters[s.request.tenant], s.request.arrival_order))

    @staticmethod
    def _tenants_share(sched: Scheduler) -> bool:
        """Whether more than one tenant holds seats or waits (stops at the second one found)."""
        tenants = set(sched.waiting.tenants())
        if len(tenants) > 1:
            return True
        for seq in sched.running:
            tenants.add(seq.request.tenant)
            if len(tenants) > 1:
                return True
        return False

    @staticmethod
    def _active_tenants(sched: Scheduler, seats: Counter[str]) -> set[str]:
        """Tenants holding seats or with sequences waiting."""
        return set(seats) | set(sched.waiting.tenants())


# name -> the policy's maker, called with (counters, fair_prompt_tokens); config.settings.SCHEDULING_NAMES lists
# the same names (config imports nothing of the runtime; a test keeps the two equal)
SCHEDULING_POLICIES: dict[str, Callable[[VirtualTokenCounters, int], SchedulingPolicy]] = {
    "fcfs": FcfsPolicy, "fair": FairPolicy}


def scheduling_policy_class(name: str) -> Callable[[VirtualTokenCounters, int], SchedulingPolicy]:
    """The maker of the policy registered under `name` (engine.scheduling)."""
    policy = SCHEDULING_POLICIES.get(name)
    if policy is None:
        raise ValueError(f"scheduling must be one of {tuple(SCHEDULING_POLICIES)}, got {name!r}")
    return policy
