"""How a front door picks a worker for a request: routing policies as objects registered by name.

    kv           Dynamo's KvRouter.best_worker: the worker whose cache holds the longest prefix
                 of the request's blocks under its tenant's salt, weighed against each
                 worker's load (Dynamo's cost function); the router tracks the request until
                 it ends (prefill_done, release)
    round_robin  the next live worker in turn
    random       a random live worker

With no worker live (each was marked lost, perhaps falsely), a pick is None and Dynamo's
client chooses from what discovery lists (`open_unpicked`); with nothing listed that raises.

    ROUTINGS = {"kv": KvRouting, "round_robin": RoundRobinRouting, "random": RandomRouting}
    (distributed.routing; make_routing builds one from the cluster's endpoint)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

from runtime.request import Request
from service.distributed.dynamo_runtime import routing_namespace


class Routing(Protocol):
    """What DynamoBridge asks of a routing policy."""

    name: str

    async def pick(self, request: Request, live: list[int]) -> tuple[int | None, bool]:
        """(worker id, whether the policy tracks the request until release), among the live workers."""

    async def open_unpicked(self, client, call: dict, context):
        """Stream the call through Dynamo's client when no worker was picked."""

    async def prefill_done(self, request_id: str) -> None:
        """A tracked request's first frame came: its prefill is over."""

    async def release(self, request_id: str) -> None:
        """A tracked request's route ended (answered, failed or routed again)."""

    async def overlap_blocks(self, token_ids: list[int], cache_salt: bytes | None,
                             num_shared_blocks: int) -> dict[str, int]:
        """Per worker, how many leading blocks of the prompt it holds, where the policy knows ({} if not)."""


class _UntrackedRouting:
    """What a policy that tracks nothing does: no hooks, no overlap scores; with no pick, Dynamo's round robin."""

    async def open_unpicked(self, client, call: dict, context):
        return await client.round_robin(call, context=context)

    async def prefill_done(self, request_id: str) -> None:
        pass

    async def release(self, request_id: str) -> None:
        pass

    async def overlap_blocks(self, token_ids: list[int], cache_salt: bytes | None,
                             num_shared_blocks: int) -> dict[str, int]:
        return {}


class RoundRobinRouting(_UntrackedRouting):
    """The next live worker in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    async def pick(self, request: Request, live: list[int]) -> tuple[int | None, bool]:
        if not live:
            return None, False
        self._turn += 1
        return live[self._turn % len(live)], False


class RandomRouting(_UntrackedRouting):
    """A random live worker."""

    name = "random"

    async def pick(self, request: Request, live: list[int]) -> tuple[int | None, bool]:
        return (random.choice(live), False) if live else (None, False)

    async def open_unpicked(self, client, call: dict, context):
        return await client.random(call, context=context)


class KvRouting(_UntrackedRouting):
    """Dynamo's KV-aware router (a KvRouter, or anything with its methods); it tracks each request it routes."""

    name = "kv"

    def __init__(self, router) -> None:
        self.router = router

    async def pick(self, request: Request, live: list[int]) -> tuple[int | None, bool]:
        """The router's best worker; if it still lists a lost one, the least loaded live worker instead."""
        namespace = routing_namespace(request.cache_salt, request.num_shared_blocks)
        worker_id, _, _ = await self.router.best_worker(request.prompt_token_ids, request_id=request.request_id,
                                                         cache_namespace=namespace)
        if worker_id in live or not live:
            return worker_id, True
        await self.router.free(request.request_id)
        loads = await self.router.get_potential_loads(request.prompt_token_ids, cache_namespace=namespace)
        alive = [load for load in loads if load["worker_id"] in live]
        best = min(alive, key=lambda load: (load["potential_prefill_tokens"], load["potential_decode_blocks"]),
                   default=None)
        return (best["worker_id"] if best else live[0]), False

    async def prefill_done(self, request_id: str) -> None:
        await self.router.mark_prefill_complete(request_id)

    async def release(self, request_id: str) -> None:
        await self.router.free(request_id)

    async def overlap_blocks(self, token_ids: list[int], cache_salt: bytes | None,
                             num_shared_blocks: int) -> dict[str, int]:
        scores = await self.router.get_overlap_scores(
            token_ids, cache_namespace=routing_namespace(cache_salt, num_shared_blocks))
        return {str(w["worker_id"]): w["device_blocks"] for w in scores["workers"]}


def _kv(core, endpoint, block_size: int, prefill_load_scale: float) -> KvRouting:
    return KvRouting(core.KvRouter(endpoint, block_size, core.KvRouterConfig(prefill_load_scale=prefill_load_scale)))


# distributed.routing -> the policy's maker, called with (the dynamo module, the workers' endpoint, the block
# size, kv_prefill_load_scale); only "kv" uses them
ROUTINGS: dict[str, Callable[..., Routing]] = {
    "kv": _kv,
    "round_robin": lambda core, endpoint, block_size, prefill_load_scale: RoundRobinRouting(),
    "random": lambda core, endpoint, block_size, prefill_load_scale: RandomRouting(),
}


def make_routing(name: str, core, endpoint, block_size: int, prefill_load_scale: float) -> Routing:
    """The routing policy registered under `name`."""
    maker = ROUTINGS.get(name)
    if maker is None:
        raise ValueError(f"routing must be one of {tuple(ROUTINGS)}, got {name!r}")
    return maker(core, endpoint, block_size, prefill_load_scale)
