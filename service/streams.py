"""Per-request streams on the event loop: the engine's step outputs, merged until read.

A slow reader never makes memory grow per step: each step's new tokens and text are
appended to one pending delta per choice, and the reader takes everything pending at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from runtime.outputs import RequestOutput, TokenLogprob


class ChoiceDelta:
    """What one choice (sample) gained since the reader last looked."""

    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # tokens whose text is in `text` so far, with logprobs
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop string or stop token id that ended it


class RequestStream:
    """A mailbox for one request's outputs, with its timing and token counts."""

    def __init__(self, request_id: str, num_prompt_tokens: int, n: int = 1, wakeup: asyncio.Event | None = None,
                 tenant: str = "default") -> None:
        self.request_id = request_id
        self.tenant = tenant  # whose places in flight it holds (service/admission.py)
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n
        self.num_cached_tokens = 0
        self.num_cache_written_tokens = 0  # prompt tokens this request put into the prefix cache
        self.num_accepted_prediction_tokens = 0
        self.num_completion_tokens = [0] * n  # per choice, tokens handed to the reader
        self.finish_reasons: list[str | None] = [None] * n
        self.finished = False
        self.error: Exception | None = None
        self.created_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.inter_token_latencies: list[float] = []  # seconds between steps that brought tokens
        self._pending: dict[int, ChoiceDelta] = {}
        self._event = wakeup or asyncio.Event()  # may be shared by the streams of one HTTP request
        self.on_engine_done: Callable[[], None] | None = None  # called once the engine finished or failed it

    # --- producer side (the bridge, on the loop) ----------------------------------------

    def push(self, output: RequestOutput, now: float) -> None:
        """Merge one step's output into the pending deltas."""
        got_tokens = False
        for completion in output.outputs:
            index = completion.index
            new_ids = completion.new_token_ids
            if not (new_ids or completion.new_text or completion.finish_reason or completion.new_logprobs):
                continue
            delta = self._pending.get(index)
            if delta is None:
                delta = self._pending[index] = ChoiceDelta(index)
            delta.text += completion.new_text
            delta.token_ids += new_ids
            if completion.new_logprobs:
                delta.logprobs += completion.new_logprobs
            if completion.finish_reason is not None:
                delta.finish_reason = completion.finish_reason
                delta.stop_reason = completion.stop_reason
                self.finish_reasons[index] = completion.finish_reason
            self.num_completion_tokens[index] += len(new_ids)
            got_tokens = got_tokens or bool(new_ids)
        self.num_cached_tokens = output.num_cached_tokens
        self.num_cache_written_tokens = output.num_cache_written_tokens
        self.num_accepted_prediction_tokens = output.num_accepted_prediction_tokens
        if got_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
            else:
                self.inter_token_latencies.append(now - self.last_token_at)
            self.last_token_at = now
        self._event.set()
        if output.finished:
            self.finished = True
            if self.on_engine_done is not None:
                self.on_engine_done()

    def close(self, reason: str) -> None:
        """End the stream from the loop side (cancel, disconnect, shutdown)."""
        if not self.finished:
            self.finished = True
            self.finish_reasons = [r or reason for r in self.finish_reasons]
        self._event.set()

    def fail(self, error: Exception) -> None:
        """End the stream with an engine error."""
        self.error = error
        self.finished = True
        self._event.set()
        if self.on_engine_done is not None:
            self.on_engine_done()

    # --- consumer side ------------------------------------------------------------------

    def take(self) -> list[ChoiceDelta]:
        """Everything pending, merged per choice; empties the mailbox."""
        pending, self._pending = list(self._pending.values()), {}
        return pending

    async def deltas(self):
        """Yield lists of ChoiceDelta as they arrive; ends when the request ends."""
        async for _, pending in follow([self], self._event):
            yield pending

    @property
    def num_output_tokens(self) -> int:
        return sum(self.num_completion_tokens)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.created_at


async def follow(streams: list[RequestStream], wakeup: asyncio.Event):
    """Yield (stream position, deltas) from streams that share `wakeup`, until all have ended.

    Raises a stream's engine error after yielding what came before it.
    """
    while True:
        await wakeup.wait()
        wakeup.clear()
        for position, stream in enumerate(streams):
            if stream._pending:
                yield position, stream.take()
            if stream.error is not None:
                raise stream.error
        # an output pushed while the reader was busy with the last yield set `wakeup` again:
        # end only once nothing is pending, or that last output would be dropped
        if all(stream.finished and not stream._pending for stream in streams):
            return
