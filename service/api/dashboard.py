"""GET /dashboard (the live page map) and GET /dashboard/events (its SSE feed of page snapshots).

One `PageMapFeed` per app (made by `add_routes`, kept under `PAGE_MAP_FEED`) polls
`engine.page_map()` through the bridge at most `PERIOD_S` apart, whatever the number of
viewers: it starts with the first viewer and stops after the last one leaves. A viewer is sent the newest snapshot when it changed, and an SSE comment every
`KEEPALIVE_S` otherwise; a slow viewer skips snapshots, it never queues them.

An event's data is one JSON object (compact: what the page draws, no prompt text):

    model, block_size, num_blocks, max_model_len
    pages            one character per page id: "." free, "c" cached-free (ref_count 0, holds a
                     hashed full block: reusable by a prefix hit), "u" in use (ref_count > 0)
    shared           [[page id, ref_count], ...] for pages with more than one reader
    pinned           {pin id: [page ids]}
    seqs             one row per live sequence, running first: [request_id, sample index (0 unless
                     n > 1), status ("r" running, "w" waiting), num_prompt_tokens, num_tokens,
                     num_computed_tokens, max_tokens, block_table (page ids in logical order),
                     num_draft_tokens, num_accepted_draft_tokens (speculative decoding, so far)]
    contiguous_pages pages a contiguous allocator would reserve now: ceil(max_model_len /
                     block_size) per live sequence
    counters         num_used_blocks, num_cached_blocks, num_free_blocks, num_kv_tokens,
                     num_running, num_waiting, prefix_cache_queries, prefix_cache_hits (tokens),
                     num_preemptions
    scheduling       "fcfs" or "fair"
    tenants          one row per tenant served: [tenant, virtual token counter, weight, prompt
                     tokens computed, tokens generated, sequences waiting, sequences running]
    apis             finished requests by API: {"chat.completions": n, "completions": n, "messages": n,
                     "responses": n} (those seen so far)
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import structlog
from aiohttp import web

from service.api.completions import SSE_HEADERS
from service.errors import APIError
from service.state import STATE, ServiceState

log = structlog.get_logger(__name__)

PAGE = Path(__file__).parent / "static" / "dashboard.html"
PERIOD_S = 0.25  # at most 4 snapshots a second
KEEPALIVE_S = 2.0
SNAPSHOT_TIMEOUT_S = 5.0
COUNTERS = ("num_used_blocks", "num_cached_blocks", "num_free_blocks", "num_kv_tokens", "num_running", "num_waiting",
            "prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


def _sample_index(seq: dict) -> int:
    """0 for a request's first sample; seq ids of the others are "<request_id>#<index>"."""
    _, _, index = seq["seq_id"].removeprefix(seq["request_id"]).partition("#")
    return int(index) if index else 0


def compact_page_map(snapshot: dict, model: str, max_model_len: int, apis: dict[str, int] | None = None) -> dict:
    """engine.page_map() -> the event payload described in the module docstring."""
    block_size = snapshot["block_size"]
    ref_count, cached = snapshot["ref_count"], snapshot["cached"]
    pages = "".join("u" if r > 0 else ("c" if c else ".") for r, c in zip(ref_count, cached))
    seqs = [[s["request_id"], _sample_index(s), s["status"][0], s["num_prompt_tokens"], s["num_tokens"],
             s["num_computed_tokens"], s["max_tokens"], s["block_table"], s.get("num_draft_tokens", 0),
             s.get("num_accepted_draft_tokens", 0)] for s in snapshot["sequences"]]
    stats = snapshot["stats"]
    return {
        "model": model, "block_size": block_size, "num_blocks": snapshot["num_blocks"], "max_model_len": max_model_len,
        "pages": pages,
        "shared": [[block_id, r] for block_id, r in enumerate(ref_count) if r > 1],
        "pinned": snapshot["pinned"],
        "seqs": seqs,
        "contiguous_pages": len(seqs) * -(-max_model_len // block_size),
        "counters": {name: stats.get(name, 0) for name in COUNTERS},
        "scheduling": stats.get("scheduling", "fcfs"),
        "tenants": [[tenant, round(row["virtual_tokens"], 1), row["weight"], row["served_input_tokens"],
                     row["served_output_tokens"], row["num_waiting"], row["num_running"]]
                    for tenant, row in sorted(stats.get("tenants", {}).items())],
        "apis": dict(sorted((apis or {}).items())),
    }


class PageMapFeed:
    """One poller shared by every viewer: the newest encoded snapshot and a version that bumps on change."""

    def __init__(self, app: web.Application, period_s: float = PERIOD_S) -> None:
        self.app = app  # its ServiceState exists only once the app has started
        self.period_s = period_s
        self.payload: bytes | None = None
        self.version = 0
        self.num_viewers = 0
        self._published = asyncio.Event()  # replaced on every publish; the old one is set
        self._poller: asyncio.Task | None = None

    @asynccontextmanager
    async def viewer(self):
        """Count a viewer for the duration; the first starts the poller, the last stops it."""
        self.num_viewers += 1
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        try:
            yield self
        finally:
            self.num_viewers -= 1
            if self.num_viewers == 0 and self._poller is not None:
                self._poller.cancel()
                self._poller = None
                self.payload = None  # stale once nobody polls; the next viewer waits for a fresh one

    async def newer_than(self, version: int, timeout_s: float) -> tuple[int, bytes | None]:
        """(version, payload) once a snapshot newer than `version` exists, or the same version after `timeout_s`."""
        if self.version == version or self.payload is None:
            published = self._published
            try:
                async with asyncio.timeout(timeout_s):
                    await published.wait()
            except TimeoutError:
                pass
        return self.version, self.payload

    async def _poll(self) -> None:
        state = self.app[STATE]
        model, max_model_len = state.model_name, state.engine.max_model_len
        failing = False
        while True:
            try:
                async with asyncio.timeout(SNAPSHOT_TIMEOUT_S):
                    snapshot = await state.bridge.page_map()
            except Exception as exc:  # the engine is stopping or broken: keep trying, log once
                if not failing:
                    log.warning("page map snapshot failed", error=repr(exc))
                failing = True
                await asyncio.sleep(1.0)
                continue
            failing = False
            payload = msgspec.json.encode(compact_page_map(snapshot, model, max_model_len,
                                                           state.metrics.requests_by_api))
            if payload != self.payload:
                self.payload, self.version = payload, self.version + 1
                published, self._published = self._published, asyncio.Event()
                published.set()
            await asyncio.sleep(self.period_s)


PAGE_MAP_FEED = web.AppKey("page_map_feed", PageMapFeed)


def add_routes(app: web.Application) -> None:
    """GET /dashboard and /dashboard/events, and the app's one feed."""
    app[PAGE_MAP_FEED] = PageMapFeed(app)
    app.router.add_get("/dashboard", dashboard_page)
    app.router.add_get("/dashboard/events", dashboard_events)


def _authorize(state: ServiceState, request: web.Request) -> None:
    """Open mode: anyone. With tenants: an admin key, as `Authorization: Bearer` or `?key=` (for a browser)."""
    if state.tenants.is_open:
        return
    authorization = request.headers.get("Authorization")
    if authorization is None and request.query.get("key"):
        authorization = f"Bearer {request.query['key']}"
    if not state.tenants.authenticate(authorization).is_admin:
        raise APIError(403, "the dashboard needs an admin key", None, "admin_key_required")


async def dashboard_page(request: web.Request) -> web.FileResponse:
    """GET /dashboard: the static page; it follows /dashboard/events."""
    _authorize(request.app[STATE], request)
    return web.FileResponse(PAGE, headers={"Cache-Control": "no-cache"})


async def dashboard_events(request: web.Request) -> web.StreamResponse:
    """GET /dashboard/events: SSE, one `data: {page map}` per change (<= 4/s), a comment every 2 s otherwise."""
    state = request.app[STATE]
    _authorize(state, request)
    if not state.ready:
        raise APIError(503, "the server is shutting down or unhealthy", None, "service_unavailable")
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    await response.write(b"retry: 2000\n\n")
    try:
        async with request.app[PAGE_MAP_FEED].viewer() as feed:
            sent = 0
            while not state.draining:  # draining: end the stream so shutdown does not wait on it
                version, payload = await feed.newer_than(sent, KEEPALIVE_S)
                if version != sent and payload is not None:
                    await response.write(b"data: " + payload + b"\n\n")
                    sent = version
                else:
                    await response.write(b": keep-alive\n\n")
    except ConnectionError:
        pass  # the viewer left
    return response
