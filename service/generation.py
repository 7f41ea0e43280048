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

from runtime.sampling_params import SamplingParams
from service.formatting import ResponseFormat, usage_dict
from service.protocol import _SamplingFields
from service.state import ServiceState
from service.streams import ChoiceDelta, RequestStream, follow

log = structlog.get_logger(__name__)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Generation:
    """Prompts -> engine requests -> merged deltas, numbered as OpenAI choices."""

    def __init__(self, state: ServiceState, body: _SamplingFields, prompts: list[list[int]], fmt: ResponseFormat,
                 tenant: str = "default") -> None:
        self.state = state
        self.body = body
        self.fmt = fmt
        self.tenant = tenant
        self.n = body.n
        self.params: list[SamplingParams] = []
        for token_ids in prompts:
            params = body.sampling_params(len(token_ids), state.engine.max_model_len)
            state.engine.check_fits(len(token_ids), params)
            self.params.append(params)
        state.check_admission(len(prompts))
        self.prompts = prompts
        self.wakeup = asyncio.Event()
        ids = [fmt.response_id] if len(prompts) == 1 else [f"{fmt.response_id}-{i}" for i in range(len(prompts))]
        self.streams = [RequestStream(rid, len(p), self.n, self.wakeup) for rid, p in zip(ids, prompts)]
        self.started_at = time.monotonic()
        self.cancelled = False

    def start(self) -> None:
        for stream, token_ids, params in zip(self.streams, self.prompts, self.params):
            self.state.bridge.submit(stream, token_ids, params)

    async def deltas(self):
        """Yield lists of (choice index, ChoiceDelta) until every choice has finished."""
        n = self.n
        async for position, pending in follow(self.streams, self.wakeup):
            yield [(position * n + delta.index, delta) for delta in pending]

    def usage(self) -> dict:
        return usage_dict(
            sum(s.num_prompt_tokens for s in self.streams),
            sum(s.num_output_tokens for s in self.streams),
            sum(s.num_cached_tokens for s in self.streams),
        )

    def finish(self) -> None:
        """Abort what is still running; record metrics and one summary line. Call exactly once."""
        elapsed = time.monotonic() - self.started_at
        for stream in self.streams:
            if not stream.finished:
                self.state.bridge.abort(stream.request_id)
            reason = "error" if stream.error else next((r for r in stream.finish_reasons if r), "abort")
            self.state.metrics.observe(stream, reason, elapsed)
        usage = self.usage()
        first = self.streams[0]
        log.info(
            "request finished", request_id=self.fmt.response_id, tenant=self.tenant,
            prompt_tokens=usage["prompt_tokens"], cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
            completion_tokens=usage["completion_tokens"],
            ttft_s=None if first.ttft is None else round(first.ttft, 4), total_s=round(elapsed, 4),
            finish_reasons=[r for s in self.streams for r in s.finish_reasons],
        )


class ChoiceAccumulator:
    """Collects deltas into whole choices (for non-streaming responses)."""

    def __init__(self) -> None:
        self.choices: dict[int, ChoiceDelta] = {}

    def add(self, index: int, delta: ChoiceDelta) -> None:
        whole = self.choices.setdefault(index, ChoiceDelta(index))
        whole.text += delta.text
        whole.token_ids += delta.token_ids
        whole.logprobs += delta.logprobs
        whole.finish_reason = delta.finish_reason or whole.finish_reason
