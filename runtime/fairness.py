r"""Who is admitted next when tenants share one engine: first come first served, or fair.

"fair" is the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI '24, arXiv 2401.00588). Each tenant's counter sums the tokens it was served,
weighted as the paper does and divided by the tenant's share weight (its plan's `weight`):

    counter[t] += (input_weight * prompt tokens computed + output_weight * tokens generated) / weight[t]

Prompt tokens found in the prefix cache are not computed, so they are not charged: a cache
hit costs a tenant less service, as it costs less on the bill. A preempted sequence's
recomputation is the engine's doing and is not charged again.

    waiting:   A: a1 a2 a3 ... a136      counter A = 9,400   (flooding, 64 running)
               B: b1                     counter B = 9,150   (lifted on arrival, then A ran on)
    admit:     b1 first (smallest counter among tenants with requests waiting)

- The queue admits from the backlogged tenant with the smallest counter (ties: the earlier
  head), taking first the tenants that hold fewer seats than their weighted share of
  max_num_seqs, the one holding the smallest part of its share first (so one admission round
  does not hand every free seat to one tenant, and a seat freed for a tenant below its share
  goes to it).
  Within a tenant, lower `priority` first (vLLM's field), then arrival; a preempted
  sequence goes back to the head of its own tenant's line.
- A tenant that sends with nothing waiting is lifted to the smallest counter of the tenants
  that have requests waiting (or, if none has, of those running), never lowered: being
  quiet banks no credit, and nobody is punished for having used capacity others left idle.
- A tenant that stays within its weighted share of max_num_seqs by starting one more request
  may take a seat from the tenant furthest ahead among those that keep at least their own share
  of seats or of the pool's pages by giving one (FairPolicy.room_victim): a
  light tenant's request then starts in the step it arrives, not after the flood's running
  requests finish, and two backlogged tenants never trade seats back and forth, even with
  shares that are not whole numbers.
- Page-pressure preemption takes its victim from the tenant furthest ahead.

"fcfs" keeps one line in arrival order (preempted sequences at its head) and ignores tenants.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

from runtime.request import Sequence

NO_TENANT_FIRST: Mapping[str, float] = MappingProxyType({})  # no tenant taken first


class VirtualTokenCounters:
    """Per-tenant weighted service counters, charged as tokens are computed and generated."""

    def __init__(self, input_weight: float, output_weight: float) -> None:
        if input_weight < 0 or output_weight < 0 or input_weight + output_weight <= 0:
            raise ValueError(f"token weights must be >= 0 and not both 0, got {input_weight}, {output_weight}")
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}  # tenant -> share weight (its plan's), as last given
        self.served_input: dict[str, int] = {}  # prompt tokens computed (not cached), per tenant
        self.served_output: dict[str, int] = {}  # tokens generated, per tenant

    def register(self, tenant: str, weight: float) -> None:
        """Note the tenant's share weight (> 0); a new tenant starts at 0."""
        if not weight > 0:
            raise ValueError(f"a tenant's weight must be > 0, got {weight}")
        self.weights[tenant] = weight
        self.counters.setdefault(tenant, 0.0)
        self.served_input.setdefault(tenant, 0)
        self.served_output.setdefault(tenant, 0)

    def charge(self, tenant: str, num_input: int = 0, num_output: int = 0) -> None:
        """Count service given to the tenant: prompt tokens computed, tokens generated."""
        self.served_input[tenant] += num_input
        self.served_output[tenant] += num_output
        cost = self.input_weight * num_input + self.output_weight * num_output
        self.counters[tenant] += cost / self.weights[tenant]

    def lift(self, tenant: str, active: Iterable[str]) -> None:
        """A tenant back from idle rises to the smallest counter among the active ones (never lowered)."""
        floor = min((self.counters[t] for t in active if t != tenant), default=None)
        if floor is not None and floor > self.counters[tenant]:
            self.counters[tenant] = floor


class FcfsQueue:
    """The waiting line in arrival order; preempted sequences go back to its head."""

    def __init__(self) -> None:
        self._line: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        self._line.append(seq)

    def push_front(self, seq: Sequence) -> None:
        self._line.appendleft(seq)

    def peek(self, first: Mapping[str, float] = NO_TENANT_FIRST) -> Sequence | None:
        """The line's head (`first` is the fair queue's; arrival order ignores tenants)."""
        return self._line[0] if self._line else None

    def pop(self, first: Mapping[str, float] = NO_TENANT_FIRST) -> Sequence:
        """Remove and return what peek() returned."""
        return self._line.popleft()

    def tenants(self) -> list[str]:
        """Tenants with sequences waiting."""
        return list(dict.fromkeys(seq.request.tenant for seq in self._line))

    def depth(self, tenant: str) -> int:
        return sum(seq.request.tenant == tenant for seq in self._line)

    def remove(self, seq: Sequence) -> None:
        self._line.remove(seq)

    def __len__(self) -> int:
        return len(self._line)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._line)


class FairQueue:
    """One line per tenant; the next sequence is the head of the backlogged tenant with the smallest counter.

    A line is a heap of (band, priority, order, seq): band 0 for preempted sequences (latest
    first), 1 for new ones, ordered by `priority` then arrival.
    """

    def __init__(self, counters: VirtualTokenCounters) -> None:
        self.counters = counters
        self._lines: dict[str, list[tuple[int, int, int, Sequence]]] = {}
        self._order = itertools.count()
        self._size = 0

    def push(self, seq: Sequence) -> None:
        request = seq.request
        self._push(seq, (1, request.priority, next(self._order), seq))

    def push_front(self, seq: Sequence) -> None:
        self._push(seq, (0, 0, -next(self._order), seq))

    def _push(self, seq: Sequence, entry: tuple[int, int, int, Sequence]) -> None:
        heapq.heappush(self._lines.setdefault(seq.request.tenant, []), entry)
        self._size += 1

    def _head_line(self, first: Mapping[str, float]) -> list[tuple[int, int, int, Sequence]] | None:
        best, best_key = None, None
        for tenant, line in self._lines.items():
            key = (tenant not in first, first.get(tenant, 0.0), self.counters.counters[tenant], line[0][0], line[0][2])
            if best_key is None or key < best_key:
                best, best_key = line, key
        return best

    def peek(self, first: Mapping[str, float] = NO_TENANT_FIRST) -> Sequence | None:
        """The next sequence. Tenants in `first` (below their share of seats, each with the part of its share it
        holds) come before the others, the one holding the smallest part first; then the smallest counter's
        line. Below their shares, the part held decides before counters: a light tenant sits level with the
        flood on counters or a few tokens ahead (lifted on arrival, charged its prompt at once), and the
        seat or pages make_room freed for it went straight back to the flood's preempted head."""
        line = self._head_line(first)
        return line[0][3] if line is not None else None

    def pop(self, first: Mapping[str, float] = NO_TENANT_FIRST) -> Sequence:
        """Remove and return what peek(first) returned."""
        line = self._head_line(first)
        if line is None:
            raise IndexError("pop from an empty queue")
        seq = heapq.heappop(line)[3]
        self._drop_if_empty(seq.request.tenant)
        self._size -= 1
        return seq

    def remove(self, seq: Sequence) -> None:
        line = self._lines.get(seq.request.tenant, [])
        for i, entry in enumerate(line):
            if entry[3] is seq:
                line[i] = line[-1]
                line.pop()
                heapq.heapify(line)
                self._drop_if_empty(seq.request.tenant)
                self._size -= 1
                return
        raise ValueError(f"sequence {seq.seq_id} is not waiting")

    def _drop_if_empty(self, tenant: str) -> None:
        if not self._lines[tenant]:
            del self._lines[tenant]

    def tenants(self) -> list[str]:
        """Tenants with sequences waiting."""
        return list(self._lines)

    def depth(self, tenant: str) -> int:
        return len(self._lines.get(tenant, ()))

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Sequence]:
        for line in self._lines.values():
            for entry in sorted(line):
                yield entry[3]
