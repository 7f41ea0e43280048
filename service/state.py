"""What every handler shares: settings, the engine (read-only from the loop), the bridge, the stores, metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from config import Settings
from runtime.errors import InvalidRequestError
from runtime.grammar import CompiledGrammar
from runtime.structured_outputs import StructuredOutputs
from service.billing.journal import UsageJournal
from service.billing.ledger import Ledger
from service.bridge import Bridge, ModelLike, Tokenizer
from service.errors import APIError
from service.metrics import ServiceMetrics
from service.pins import PinRegistry
from service.prefix_index import PrefixIndex
from service.rate_limit import RateLimiter
from service.tenants import Tenant, TenantDirectory


@dataclass
class ServiceState:
    settings: Settings
    engine: ModelLike  # the engine (its read-only part) or, behind Dynamo, a RemoteModel
    bridge: Bridge
    metrics: ServiceMetrics
    model_name: str
    tenants: TenantDirectory
    ledger: Ledger
    journal: UsageJournal
    pins: PinRegistry
    limiter: RateLimiter
    prefix_index: PrefixIndex | None  # None behind Dynamo: its indexer is the one source of truth
    replica_id: str
    draining: bool = False
    num_reserved: int = 0  # sequences admitted but not yet handed to the bridge
    created: float = field(default_factory=time.time)
    background: set = field(default_factory=set)  # fire-and-forget tasks, held until done
    compiling: dict = field(default_factory=dict)  # constraint cache key -> its compile in flight

    def spawn(self, coro) -> None:
        """Run `coro` in the background, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def authenticate(self, request: web.Request) -> Tenant:
        """The caller's tenant from `Authorization: Bearer`, or 401."""
        return self.tenants.authenticate(request.headers.get("Authorization"))

    async def compile_grammar(self, spec: StructuredOutputs | None) -> CompiledGrammar | None:
        """The compiled grammar of an output constraint: from the cache, else compiled on a worker thread.

        Raises InvalidRequestError (a 400 naming the constraint's field) if it cannot compile.
        """
        if spec is None:
            return None
        compiler = self.engine.grammars
        compiled = compiler.cached(spec)
        if compiled is not None:
            return compiled
        key = spec.cache_key()
        pending = self.compiling.get(key)  # the same new schema from many requests at once: compiled once
        if pending is None:
            pending = self.compiling[key] = asyncio.get_running_loop().run_in_executor(None, compiler.compile, spec)
            pending.add_done_callback(lambda _: self.compiling.pop(key, None))
        try:
            return await asyncio.shield(pending)
        except InvalidRequestError as exc:  # one compile, but each request names its own field
            raise InvalidRequestError(exc.message, param=spec.param, code=exc.code) from exc

    def encode_prefix(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def ready(self) -> bool:
        return not self.draining and self.bridge.healthy

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def reserve_capacity(self, num_sequences: int) -> None:
        """503 while draining or broken; 429 when the queue beyond the running batch is full;
        else hold `num_sequences` places until release_capacity (the bridge counts them once submitted)."""
        if not self.ready:
            raise APIError(503, "the server is shutting down or unhealthy; retry on another replica", None,
                           "service_unavailable", {"Retry-After": "5"})
        per_worker = self.engine.limits.max_num_seqs + self.settings.server.max_queued_requests  # workers' own sizes
        limit = per_worker * max(1, self.bridge.num_workers)
        if self.bridge.num_inflight_sequences + self.num_reserved + num_sequences > limit:
            raise APIError(429, f"the server is at capacity ({limit} sequences in flight); retry shortly", None,
                           "too_many_requests", {"Retry-After": "1"})
        self.num_reserved += num_sequences

    def release_capacity(self, num_sequences: int) -> None:
        self.num_reserved -= num_sequences


STATE = web.AppKey("state", ServiceState)
