"""Per-tenant endpoints: usage totals, pinned prefixes; the prefix-index lookup for operators."""

from __future__ import annotations

import asyncio
import math
import time
import uuid

import msgspec
from aiohttp import web
from redis.exceptions import RedisError

from runtime.block_hash import extend_block_hashes
from runtime.json_limits import decode_json
from runtime.sampling_params import SamplingParams
from service.billing.usage import UsageRecord, cost_pico_usd
from service.errors import APIError
from service.request_lease import RequestLease
from service.pins import Pin
from service.state import STATE, ServiceState
from service.tenants import Tenant


USAGE_APPLY_WAIT_S = 2.0


async def _from_store(awaitable):
    """Await a ledger/index call; an unreachable store is a 503 the client may retry, not a 500."""
    try:
        return await awaitable
    except (OSError, RedisError) as exc:
        raise APIError(503, f"the usage store is unreachable ({exc.__class__.__name__}); retry shortly", None,
                       "store_unavailable", {"Retry-After": "5"}) from exc


def _number(request: web.Request, name: str) -> float | None:
    value = request.query.get(name)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise APIError(400, f"{name} must be unix seconds, got {value!r}", name, "invalid_value")
    return seconds


def _target_tenant(state: ServiceState, caller: Tenant, request: web.Request) -> str:
    """The caller's own tenant; an admin key may name any tenant with ?tenant=."""
    asked = request.query.get("tenant")
    if asked is None or asked == caller.tenant_id:
        if caller.tenant_id not in state.tenants.tenants:
            raise APIError(400, "an admin key must name a tenant: ?tenant=...", "tenant", "missing_tenant")
        return caller.tenant_id
    if not caller.is_admin:
        raise APIError(404, "no such tenant for this key", "tenant", "tenant_not_found")  # no existence leak
    if asked not in state.tenants.tenants:
        raise APIError(404, f"no tenant named {asked!r}", "tenant", "tenant_not_found")
    return asked


async def usage(request: web.Request) -> web.Response:
    """GET /v1/usage[?since=&until=][&tenant= for admins]: tokens, cached tokens, cost (exact decimal)."""
    state = request.app[STATE]
    caller = state.authenticate(request)
    tenant_id = _target_tenant(state, caller, request)
    try:  # every answer already sent is on disk; let the journal hand it to the ledger first
        await state.journal.wait_applied(USAGE_APPLY_WAIT_S)
    except TimeoutError:
        pass  # the ledger is slow or down: the body's pending_records says how many are not counted yet
    totals = await _from_store(state.ledger.totals(tenant_id, _number(request, "since"), _number(request, "until")))
    body = totals.to_json(tenant_id)
    body["pending_records"] = state.journal.num_pending
    return web.json_response(body)


class PinBody(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    text: str


def _engine_pin_id(tenant_id: str, pin_id: str) -> str:
    return f"{tenant_id}/{pin_id}"


def _pin_prompt(state: ServiceState, text: str) -> tuple[list[int], int]:
    """(the pin's token ids, its operator-shared prefix length): on a preprocessing thread."""
    token_ids = state.engine.request_builder.tokenize(text)
    return token_ids, state.tenants.shared_prefix_len(token_ids, state.encode_prefix)  # hashed as requests will be


async def pin_prefix(state: ServiceState, tenant: Tenant, pin_id: str, token_ids: list[int], shared: int,
                     by_operator: bool = False) -> int:
    """Prefill the pin under the tenant's salt and hold its pages, within the tenant's share of the pin
    budget (service/pin_budget.py; an operator's pin only within the pool's); the prefill's cached tokens."""
    if by_operator:
        state.pin_budget.release(tenant.tenant_id, pin_id)  # re-pinned by the operator: no longer the tenant's
    else:
        state.pin_budget.reserve(tenant, pin_id, len(token_ids) // state.engine.block_size)
    try:
        return await state.bridge.pin(_engine_pin_id(tenant.tenant_id, pin_id), token_ids,
                                      state.tenants.cache_salt(tenant.tenant_id), shared)
    except BaseException:
        state.pin_budget.release(tenant.tenant_id, pin_id)
        raise


async def restore_pin(state: ServiceState, pin: Pin) -> None:
    """Re-pin a registered prefix at start-up (the operator's restart: billed to no one)."""
    tenant = state.tenants.tenants.get(pin.tenant)
    if tenant is None:
        raise ValueError(f"no tenant {pin.tenant!r} in the tenants file")
    token_ids, shared = await state.preprocess(tenant, _pin_prompt, state, pin.text)
    await pin_prefix(state, tenant, pin.pin_id, token_ids, shared, pin.by_operator)


def _bill_pin(state: ServiceState, tenant: Tenant, token_ids: list[int], num_cached: int,
              created_at: float) -> asyncio.Future:
    """The pin's prefill on its tenant's bill, as a request of prompt tokens only; done once on disk."""
    record = UsageRecord(request_id=f"pin-{uuid.uuid4().hex}", tenant=tenant.tenant_id, model=state.model_name,
                         prompt_tokens=len(token_ids), cached_tokens=min(num_cached, len(token_ids)),
                         completion_tokens=0, finish_reason="pin", created_at=created_at, finished_at=time.time())
    return state.journal.append(record, cost_pico_usd(record, tenant.price_plan(state.model_name)))


async def create_pin(request: web.Request) -> web.Response:
    """POST /v1/pinned-prefixes {"id", "text"}: keep a system prompt's pages resident; survives restarts.

    A tenant's pin counts against the tenant's limits like any request, its pages against the tenant's
    pin budget, and its prefill is on the tenant's bill (the answer comes once that record is on disk).
    A pin an admin key makes for a tenant (?tenant=) is the operator's: neither counted nor billed."""
    created_at = time.time()
    state = request.app[STATE]
    caller = state.authenticate(request)
    tenant = state.tenants.tenants[_target_tenant(state, caller, request)]
    by_operator = caller.is_admin and "tenant" in request.query and not state.tenants.is_open
    counted = caller if by_operator else tenant  # whose limits and preprocessing line the request takes
    raw = await state.read_body(request)
    async with RequestLease(state, counted, len(raw)) as lease:
        body, (token_ids, shared) = await state.preprocess(counted, _pin_request, state, raw)
        lease.used_tokens = len(token_ids)
        await lease.extend_to(len(token_ids))
        num_cached = await pin_prefix(state, tenant, body.id, token_ids, shared, by_operator)
        billed = None if by_operator else _bill_pin(state, tenant, token_ids, num_cached, created_at)
        await _from_store(state.pins.add(tenant.tenant_id, body.id, body.text, by_operator))
        if billed is not None:
            await billed
    return web.json_response({"id": body.id, "tenant": tenant.tenant_id, "pinned": True, "by_operator": by_operator,
                              "usage": {"prompt_tokens": len(token_ids), "cached_tokens": num_cached}}, status=201)


def _pin_request(state: ServiceState, raw: bytes) -> tuple[PinBody, tuple[list[int], int]]:
    """The body, its prompt's token ids and shared prefix length (on a preprocessing thread)."""
    body = decode_json(raw, type=PinBody)
    if not body.id or len(body.id) > 128:
        raise APIError(400, "id must be 1 to 128 characters", "id", "invalid_value")
    return body, _pin_prompt(state, body.text)


async def list_pins(request: web.Request) -> web.Response:
    state = request.app[STATE]
    caller = state.authenticate(request)
    tenant_id = _target_tenant(state, caller, request)
    pins = [p for p in await _from_store(state.pins.list()) if p.tenant == tenant_id]
    return web.json_response({"data": [{"id": p.pin_id, "text": p.text, "created_at": p.created_at,
                                        "by_operator": p.by_operator} for p in pins]})


async def delete_pin(request: web.Request) -> web.Response:
    state = request.app[STATE]
    caller = state.authenticate(request)
    tenant_id = _target_tenant(state, caller, request)
    pin_id = request.match_info["pin_id"]
    removed = await _from_store(state.pins.remove(tenant_id, pin_id))
    await state.bridge.unpin(_engine_pin_id(tenant_id, pin_id))
    state.pin_budget.release(tenant_id, pin_id)
    if not removed:
        raise APIError(404, f"no pinned prefix {pin_id!r}", "id", "pin_not_found")
    return web.json_response({"id": pin_id, "deleted": True})


async def prefix_index_lookup(request: web.Request) -> web.Response:
    """GET /v1/prefix-index/lookup?tenant=&prompt= (admin): each replica's longest cached prefix, in blocks."""
    state = request.app[STATE]
    caller = state.authenticate(request)
    if not caller.is_admin and not state.tenants.is_open:
        raise APIError(404, "not found", None, None)
    tenant_id = request.query.get("tenant", caller.tenant_id if not caller.is_admin else "")
    if tenant_id not in state.tenants.tenants:
        raise APIError(400, "name a tenant: ?tenant=...", "tenant", "missing_tenant")
    prompt = request.query.get("prompt")
    if prompt is None:
        raise APIError(400, "give the prompt text: ?prompt=...", "prompt", "missing_prompt")
    builder = state.engine.request_builder
    token_ids = builder.tokenize(prompt)
    salt = state.tenants.cache_salt(tenant_id, request.query.get("cache_salt"))
    shared = state.tenants.shared_prefix_len(token_ids, state.encode_prefix)
    probe = builder.prepare_request("prefix-lookup", token_ids, SamplingParams(max_tokens=0), salt, shared)
    hashes: list[bytes] = []  # as the engine hashes this prompt's full blocks
    extend_block_hashes(hashes, token_ids, state.engine.block_size, probe.cache_salt, probe.num_shared_blocks)
    if state.prefix_index is None:  # behind Dynamo (DynamoBridge): its indexer, per worker id
        replicas = await state.bridge.overlap_blocks(token_ids, probe.cache_salt, probe.num_shared_blocks)
    else:
        replicas = await _from_store(state.prefix_index.lookup(hashes))
    return web.json_response({"tenant": tenant_id, "num_prompt_tokens": len(token_ids), "num_full_blocks": len(hashes),
                              "replicas": replicas})
