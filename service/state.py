"""What every handler shares: settings, the engine (read-only from the loop), the bridge, the stores, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from config import Settings
from runtime.grammar import CompiledGrammar
from runtime.structured_outputs import StructuredOutputs
from service.billing.journal import UsageJournal
from service.billing.ledger import Ledger
from service.bridge.protocols import Bridge, ModelLike, Tokenizer
from service.admission import AdmissionTimeout, FairAdmission
from service.errors import APIError
from service.grammars import LoopCompiles
from service.metrics import ServiceMetrics
from service.pin_budget import PinBudget
from service.pins import PinRegistry
from service.prefix_index import PrefixIndex
from service.preprocessing import Preprocessing
from service.rate_limit import RateLimiter
from service.responses_store import ResponseStore
from service.tenants import Tenant, TenantDirectory

T = TypeVar("T")


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
    responses: ResponseStore | None = None  # stored Responses API responses (SQLite, or Redis when configured)
    running_responses: dict = field(default_factory=dict)  # (tenant, response id) -> its responses.Run, while it runs
    draining: bool = False
    created: float = field(default_factory=time.time)
    background: set = field(default_factory=set)  # fire-and-forget tasks, held until done
    grammar_compiles: LoopCompiles = field(init=False)  # the model's compiler, driven from this loop
    preprocessing: Preprocessing = field(init=False)  # bodies parsed and tokenized off the loop, a line per tenant
    admission: FairAdmission = field(init=False)  # places in flight, fair across tenants when they run out
    tenant_weights: dict[str, float] = field(init=False)  # plan weights by tenant id
    pin_budget: PinBudget = field(init=False)  # each tenant's share of the pinned pages

    def __post_init__(self) -> None:
        self.grammar_compiles = LoopCompiles(self.engine.request_builder.grammars)
        self.preprocessing = Preprocessing(self.settings.server.preprocessing_threads,
                                           bulk_bytes=self.settings.server.preprocessing_bulk_bytes,
                                           bulk_nice=self.settings.server.preprocessing_bulk_nice)
        self.admission = FairAdmission(lambda: self.capacity, self.bridge.inflight_sequences_by_tenant,
                                       self.settings.server.admission_wait_s)
        self.tenant_weights = {t.tenant_id: t.weight for t in self.tenants.tenants.values()}
        pool_pages = getattr(self.engine, "pinned_block_budget", self.settings.engine.pinned_block_budget)
        self.pin_budget = PinBudget(pool_pages, max(1, len(self.tenants.tenants)))

    def spawn(self, coro) -> None:
        """Run `coro` in the background, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def preprocess(self, tenant: Tenant, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` off the event loop, in the tenant's line (service/preprocessing.py): parsing, templates,
        tokenizing, validating."""
        return await self.preprocessing.run(tenant.tenant_id, fn, *args)

    async def read_body(self, request: web.Request) -> bytes:
        """The request's body, whole within server.body_timeout_s of asking (a slow sender holds a handler and
        its buffer): else 408, and the connection closes after the answer."""
        try:
            async with asyncio.timeout(self.settings.server.body_timeout_s):
                return await request.read()
        except TimeoutError:
            if request.protocol is not None:
                request.protocol.keep_alive(False)  # what is left of the body is never read
            raise APIError(408, f"the request body did not arrive within {self.settings.server.body_timeout_s:g} s",
                           None, "request_timeout") from None

    def authenticate(self, request: web.Request) -> Tenant:
        """The caller's tenant from `Authorization: Bearer`, or 401."""
        return self.tenants.authenticate(request.headers.get("Authorization"))

    async def compile_grammar(self, spec: StructuredOutputs | None) -> CompiledGrammar | None:
        """The compiled grammar of an output constraint, compiled off the loop (service/grammars.py).

        Raises InvalidRequestError (a 400 naming the constraint's field) if it cannot compile.
        """
        return await self.grammar_compiles.compile(spec)

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

    @property
    def capacity(self) -> int:
        """Sequences in flight the server takes: every engine's seats and queue (behind Dynamo, summed over workers)."""
        per_worker = self.engine.limits.max_num_seqs + self.settings.server.max_queued_requests  # workers' own sizes
        return per_worker * max(1, self.bridge.num_workers)

    async def reserve_capacity(self, tenant: Tenant, num_sequences: int) -> None:
        """503 while draining or broken; when the places in flight are taken, a wait for one, handed out fairly
        across tenants (service/admission.py), then 429; else hold `num_sequences` places until
        release_capacity (the bridge counts them once submitted)."""
        self._check_serving()
        try:
            await self.admission.reserve(tenant.tenant_id, tenant.weight, num_sequences, self.tenant_weights)
        except AdmissionTimeout:
            raise APIError(429, f"the server is at capacity ({self.capacity} sequences in flight); retry shortly",
                           None, "too_many_requests", {"Retry-After": "1"}) from None
        try:
            self._check_serving()  # it may have begun draining during the wait
        except APIError:
            self.release_capacity(tenant, num_sequences)
            raise

    def _check_serving(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", None,
                           "service_unavailable", {"Retry-After": "5"})
        if not self.bridge.healthy:
            what = "no worker is reachable" if self.bridge.num_workers == 0 else "the engine is unhealthy"
            raise APIError(503, f"{what}; retry shortly", None, "service_unavailable", {"Retry-After": "2"})

    def release_capacity(self, tenant: Tenant, num_sequences: int) -> None:
        self.admission.release(tenant.tenant_id, num_sequences)


STATE = web.AppKey("state", ServiceState)
