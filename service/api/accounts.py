"""Per-tenant endpoints: usage totals, pinned prefixes; the prefix-index lookup for operators."""

from __future__ import annotations

import math

import msgspec
from aiohttp import web
from redis.exceptions import RedisError

from runtime.block_hash import extend_block_hashes
from runtime.json_limits import check_json_depth
from runtime.sampling_params import SamplingParams
from service.errors import APIError
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


async def pin_prefix(state: ServiceState, tenant_id: str, pin_id: str, text: str) -> None:
    """Prefill `text` under the tenant's salt and hold its pages (budget permitting)."""
    token_ids = state.engine.tokenize(text)
    shared = state.tenants.shared_prefix_len(token_ids, state.encode_prefix)  # hash as requests will
    await state.bridge.pin(_engine_pin_id(tenant_id, pin_id), token_ids, state.tenants.cache_salt(tenant_id), shared)


async def create_pin(request: web.Request) -> web.Response:
    """POST /v1/pinned-prefixes {"id", "text"}: keep a system prompt's pages resident; survives restarts."""
    state = request.app[STATE]
    caller = state.authenticate(request)
    tenant_id = _target_tenant(state, caller, request)
    raw = await request.read()
    check_json_depth(raw)
    body = msgspec.json.decode(raw, type=PinBody, strict=True)
    if not body.id or len(body.id) > 128:
        raise APIError(400, "id must be 1 to 128 characters", "id", "invalid_value")
    await pin_prefix(state, tenant_id, body.id, body.text)
    await _from_store(state.pins.add(tenant_id, body.id, body.text))
    return web.json_response({"id": body.id, "tenant": tenant_id, "pinned": True}, status=201)


async def list_pins(request: web.Request) -> web.Response:
    state = request.app[STATE]
    caller = state.authenticate(request)
    tenant_id = _target_tenant(state, caller, request)
    pins = [p for p in await _from_store(state.pins.list()) if p.tenant == tenant_id]
    return web.json_response({"data": [{"id": p.pin_id, "text": p.text, "created_at": p.created_at} for p in pins]})


async def delete_pin(request: web.Request) -> web.Response:
    state = request.app[STATE]
    caller = state.authenticate(request)
    tenant_id = _target_tenant(state, caller, request)
    pin_id = request.match_info["pin_id"]
    removed = await _from_store(state.pins.remove(tenant_id, pin_id))
    await state.bridge.unpin(_engine_pin_id(tenant_id, pin_id))
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
    token_ids = state.engine.tokenize(prompt)
    salt = state.tenants.cache_salt(tenant_id, request.query.get("cache_salt"))
    shared = state.tenants.shared_prefix_len(token_ids, state.encode_prefix)
    probe = state.engine.prepare_request("prefix-lookup", token_ids, SamplingParams(max_tokens=0), salt, shared)
    hashes: list[bytes] = []  # as the engine hashes this prompt's full blocks
    extend_block_hashes(hashes, token_ids, state.engine.block_size, probe.cache_salt, probe.num_shared_blocks)
    if state.prefix_index is None:  # behind Dynamo (DynamoBridge): its indexer, per worker id
        replicas = await state.bridge.overlap_blocks(token_ids, probe.cache_salt, probe.num_shared_blocks)
    else:
        replicas = await _from_store(state.prefix_index.lookup(hashes))
    return web.json_response({"tenant": tenant_id, "num_prompt_tokens": len(token_ids), "num_full_blocks": len(hashes),
                              "replicas": replicas})
