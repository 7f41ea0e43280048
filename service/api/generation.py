"""One API request in flight: its engine requests (one per prompt), their streams, its usage.

Shared by the HTTP endpoints (SSE or JSON) and the WebSocket: validate, admit, submit,
follow the deltas, and on the way out always abort what is unfinished and record the
request (metrics and one log line).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog

from redis.exceptions import RedisError

from runtime.grammar import CompiledGrammar
from runtime.request import Request
from runtime.structured_outputs import StructuredOutputs
from service.errors import APIError
from service.api.formatting import ResponseFormat, usage_dict
from service.api.openai_fields import ignored_fields
from service.request_lease import RequestLease
from service.tenants import Tenant
from service.billing.usage import UsageRecord, cost_pico_usd
from service.api.protocol import SamplingFields
from service.state import ServiceState
from service.streams import ChoiceDelta, RequestStream, follow

log = structlog.get_logger(__name__)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Generation:
    """Prompts -> engine requests -> merged deltas, numbered as OpenAI choices."""

    def __init__(self, state: ServiceState, body: SamplingFields, prompts: list[list[int]], fmt: ResponseFormat,
                 tenant: Tenant, constraint: StructuredOutputs | None = None,
                 grammar: CompiledGrammar | None = None) -> None:
        self.state = state
        self.body = body
        self.fmt = fmt
        self.tenant = tenant
        self.n = body.samples_per_prompt  # samples per prompt in the engine (best_of may return fewer)
        self.lease = None
        cache_salt = state.tenants.cache_salt(tenant.tenant_id, body.cache_salt)
        ids = [fmt.response_id] if len(prompts) == 1 else [f"{fmt.response_id}-{i}" for i in range(len(prompts))]
        self.requests: list[Request] = []  # validated here, once; the engine queues them as they are
        self.prediction = body.prediction_text()  # Predicted Outputs' text, or None
        builder = state.engine.request_builder
        for request_id, token_ids in zip(ids, prompts):
            params = body.sampling_params(len(token_ids), state.engine.max_model_len, constraint)
            shared = state.tenants.shared_prefix_len(token_ids, state.encode_prefix, body.prompt_cache_key)
            self.requests.append(builder.prepare_request(request_id, token_ids, params, cache_salt, shared,
                                                         prompt_param=body.prompt_param, grammar=grammar,
                                                         prediction=self.prediction, tenant=tenant.tenant_id,
                                                         tenant_weight=tenant.weight, priority=body.priority))
        self.wakeup = asyncio.Event()
        self.streams = [RequestStream(r.request_id, len(r.prompt_token_ids), self.n, self.wakeup, tenant.tenant_id)
                        for r in self.requests]
        for stream in self.streams:  # bill as soon as the engine is done: the fsync overlaps the last writes
            stream.on_engine_done = self._on_engine_done
        self.started_at = time.monotonic()
        self.admitted_at: float | None = None  # capacity and limits said yes (admit)
        self.submitted_at: float | None = None  # handed to the engine (start)
        self.created_at = time.time()
        self.admitted = False  # set once capacity and the tenant's limits said yes: then finish() must run
        self._recorded: asyncio.Future | None = None  # finish()'s: done once the usage records are on disk
        self._finishing = False
        self.num_sequences = len(prompts) * self.n
        self.ignored_fields = ignored_fields(body, body.fields_table)  # named in a header and the summary line
        self.api = fmt.api  # which API asked (metrics, dashboard, the summary line); chat_generation may say another

    async def admit(self, lease: RequestLease) -> None:
        """Server capacity (503/429), then the rest of the request's tokens on its tenant's lease (429).

        Tokens counted against tokens_per_minute are prompt + n * max_tokens (as OpenAI counts
        them), corrected to what was used on release. From here the lease is this request's: its
        finish() gives it back.
        """
        state = self.state
        await state.reserve_capacity(self.tenant, self.num_sequences)
        self.admitted_at = time.monotonic()
        try:
            await lease.extend_to(sum(len(r.prompt_token_ids) + r.params.n * r.params.max_tokens for r in self.requests))
        except BaseException:
            state.release_capacity(self.tenant, self.num_sequences)
            raise
        self.lease = lease.hand_over()
        self.admitted = True

    def start(self) -> None:
        """Hand every prompt to the engine (after admit())."""
        self.state.release_capacity(self.tenant, self.num_sequences)  # the bridge counts them from here on
        self.submitted_at = time.monotonic()
        for stream, request in zip(self.streams, self.requests):
            self.state.bridge.submit(stream, request)

    async def deltas(self):
        """Yield lists of (choice index, ChoiceDelta) until every choice has finished."""
        n = self.n
        async for position, pending in follow(self.streams, self.wakeup):
            yield [(position * n + delta.index, delta) for delta in pending]

    def _on_engine_done(self) -> None:
        """A stream's engine request ended (inside the bridge's delivery): bill once all have."""
        if self._recorded is None and all(stream.finished for stream in self.streams):
            try:
                self.finish()
            except Exception:  # never break the delivery of other streams; the handler then answers 503
                log.exception("billing at the engine's end failed", request_id=self.fmt.response_id)

    @property
    def num_cache_written_tokens(self) -> int:
        """Prompt tokens this request put into the prefix cache (at most its uncached prompt tokens)."""
        return sum(min(s.num_cache_written_tokens, s.num_prompt_tokens - s.num_cached_tokens) for s in self.streams)

    def usage(self) -> dict:
        usage = usage_dict(
            sum(s.num_prompt_tokens for s in self.streams),
            sum(s.num_output_tokens for s in self.streams),
            sum(s.num_cached_tokens for s in self.streams),
        )
        if self.prediction is not None:  # Predicted Outputs: how much of the prediction was kept
            predicted = sum(len(r.prediction_token_ids) * r.params.n for r in self.requests)
            accepted = sum(s.num_accepted_prediction_tokens for s in self.streams)
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                  "rejected_prediction_tokens": max(0, predicted - accepted)}
        return usage

    def finish(self) -> asyncio.Future:
        """Abort what is still running; bill, record metrics and one summary line.

        Every engine request produces one usage record, cancelled ones included: the whole
        prompt (it was accepted) and the completion tokens that were computed and handed out.
        Idempotent: the first call does the work; every call returns the future that is done
        once all of this request's records are on disk (see `usage_recorded`).
        """
        if self._recorded is not None:
            return self._recorded
        if self._finishing:  # an earlier call raised part way: never bill (or release) twice
            return _failed(RuntimeError(f"billing of {self.fmt.response_id} failed part way"))
        self._finishing = True
        elapsed = time.monotonic() - self.started_at
        finished_at = time.time()
        state = self.state
        for stream in self.streams:  # first stop the engine work, whatever happens below
            if not stream.finished:
                state.bridge.abort(stream.request_id)
        usage = self.usage()
        if self.lease is not None:
            state.spawn(self._release(usage["total_tokens"]))
        plan = self.tenant.price_plan(state.model_name)
        on_disk: list[asyncio.Future] = []
        for stream in self.streams:
            reason = "error" if stream.error else next((r for r in stream.finish_reasons if r), "abort")
            record = UsageRecord(
                request_id=stream.request_id, tenant=self.tenant.tenant_id, model=state.model_name,
                prompt_tokens=stream.num_prompt_tokens, cached_tokens=stream.num_cached_tokens,
                completion_tokens=stream.num_output_tokens, finish_reason=reason,
                created_at=self.created_at, finished_at=finished_at,
            )
            try:
                on_disk.append(state.journal.append(record, cost_pico_usd(record, plan)))
            except Exception as exc:  # one bad record must not stop the others from being billed
                log.exception("usage record not journaled", request_id=stream.request_id)
                on_disk.append(_failed(exc))
            state.metrics.observe(stream, reason, elapsed)
        state.metrics.count_api(self.api)
        first = self.streams[0]
        log.info(
            "request finished", request_id=self.fmt.response_id, api=self.api, tenant=self.tenant.tenant_id,
            prompt_tokens=usage["prompt_tokens"], cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
            completion_tokens=usage["completion_tokens"],
            ttft_s=None if first.ttft is None else round(first.ttft, 4), total_s=round(elapsed, 4),
            finish_reasons=[r for s in self.streams for r in s.finish_reasons],
            **({"ignored_fields": self.ignored_fields} if self.ignored_fields else {}),
            **({"user": self.body.user} if self.body.user else {}),
            **({"safety_identifier": sid} if (sid := getattr(self.body, "safety_identifier", None)) else {}),
        )
        if state.settings.server.trace_requests:
            self._log_trace()
        self._recorded = on_disk[0] if len(on_disk) == 1 else asyncio.gather(*on_disk)
        self._recorded.add_done_callback(self._note_unrecorded)
        return self._recorded

    def _log_trace(self) -> None:
        """One "request trace" line (server.trace_requests): each stage in ms from the request's Generation, the
        engine's steps that started it and sampled its first token (runtime/timeline.py); bench/trace_requests.py."""
        origin = self.started_at

        def ms(at: float | None) -> float | None:
            return None if at is None else round(1000 * (at - origin), 2)

        for stream, request in zip(self.streams, self.requests):
            timeline = request.timeline  # None behind Dynamo: the worker's engine steps it
            log.info("request trace", request_id=stream.request_id, tenant=self.tenant.tenant_id,
                     prompt_tokens=stream.num_prompt_tokens, cached_tokens=stream.num_cached_tokens,
                     admitted_ms=ms(self.admitted_at), submitted_ms=ms(self.submitted_at),
                     engine=None if timeline is None else timeline.as_dict(origin),
                     delivered_ms=ms(stream.first_token_at))

    async def usage_recorded(self) -> None:
        """finish(), then wait until its usage records are on disk: call before the last message.

        Raises APIError 503 if they are not written within server.usage_write_timeout_s (the
        records stay queued in the journal; the answer's end is withheld rather than unbilled).
        """
        recorded = self.finish()
        if not self.state.settings.server.reply_after_usage_on_disk:
            return
        if not recorded.done():  # asyncio.wait never cancels `recorded`, even when this task is cancelled
            await asyncio.wait([recorded], timeout=self.state.settings.server.usage_write_timeout_s)
        error = None if not recorded.done() or recorded.cancelled() else recorded.exception()
        if not recorded.done() or recorded.cancelled() or error is not None:
            raise APIError(503, "the usage record of this request could not be written; retry shortly", None,
                           "usage_not_recorded", {"Retry-After": "5"}) from error

    def _note_unrecorded(self, recorded: asyncio.Future) -> None:
        if not recorded.cancelled() and recorded.exception() is not None:
            log.error("usage records not on disk", request_id=self.fmt.response_id, error=str(recorded.exception()))

    async def _release(self, total_tokens: int) -> None:
        try:
            await self.state.limiter.release(self.lease, total_tokens)
        except (OSError, RedisError) as exc:
            log.warning("rate limiter unreachable on release", error=str(exc), tenant=self.tenant.tenant_id)


def _failed(error: Exception) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(error)
    return future


class ChoiceAccumulator:
    """Collects deltas into whole choices (for non-streaming responses)."""

    def __init__(self) -> None:
        self.choices: dict[int, ChoiceDelta] = {}

    def best(self, samples_per_prompt: int, n: int) -> list[ChoiceDelta]:
        """Per prompt, the n samples with the highest mean logprob per token (best_of), renumbered, in order."""
        picked = []
        for start in range(0, len(self.choices), samples_per_prompt):
            samples = [self.choices[i] for i in range(start, start + samples_per_prompt)]
            ranked = sorted(samples, key=lambda c: -sum(t.logprobs[t.token_id] for t in c.logprobs) / max(1, len(c.logprobs)))
            for j, choice in enumerate(ranked[:n]):
                choice.index = len(picked)
                picked.append(choice)
        return picked

    def add(self, index: int, delta: ChoiceDelta) -> None:
        whole = self.choices.setdefault(index, ChoiceDelta(index))
        whole.text += delta.text
        whole.token_ids += delta.token_ids
        whole.logprobs += delta.logprobs
        whole.finish_reason = delta.finish_reason or whole.finish_reason
        whole.stop_reason = delta.stop_reason if delta.finish_reason else whole.stop_reason
