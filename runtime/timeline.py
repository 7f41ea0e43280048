"""When a request met each stage of the engine, and what the steps that carried it held (tracing).

Off by default: `Engine.trace_requests = True` turns it on (the service does for
server.trace_requests; bench/trace_requests.py reads the result). Times are time.monotonic(),
the clock the service stamps its own stages with, so one request's timeline reads across the
threads:

    queued_at ........ first_scheduled (the step that started its prompt) ... first_token (the step that sampled it)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepShape:
    """One engine step: when it ran, how long, and what it computed."""

    index: int  # the engine's step count
    started_at: float  # time.monotonic() when scheduling began
    duration_s: float  # scheduling, forward and sampling
    num_seqs: int
    num_tokens: int
    num_decodes: int  # entries computed as decodes; the rest are prompt chunks
    num_waiting: int  # sequences left waiting after this step's scheduling
    num_running: int


@dataclass
class RequestTimeline:
    """One request's stamps: set on the engine thread, read by the service once the request has ended."""

    queued_at: float | None = None  # handed to the engine (Engine.add)
    queued_step: int = 0  # the engine's step count then
    first_scheduled: StepShape | None = None  # the step that computed its first prompt tokens
    first_token: StepShape | None = None  # the step that sampled its first token

    def as_dict(self, origin: float) -> dict:
        """Plain data, times in ms from `origin` (a time.monotonic())."""
        def shape(step: StepShape | None) -> dict | None:
            if step is None:
                return None
            out = asdict(step)
            out["started_ms"] = round(1000 * (out.pop("started_at") - origin), 2)
            out["duration_ms"] = round(1000 * out.pop("duration_s"), 2)
            return out

        return {"queued_ms": None if self.queued_at is None else round(1000 * (self.queued_at - origin), 2),
                "first_scheduled": shape(self.first_scheduled), "first_token": shape(self.first_token),
                # steps that ran after it was queued and before the one that started it
                "num_steps_waited": None if self.first_scheduled is None else
                self.first_scheduled.index - self.queued_step}
