"""Where a request's first token waits, read from a server's "request trace" lines (server.trace_requests).

    .venv/bin/python bench/trace_requests.py SERVER_LOG [--tenant ID]

A server started with PAGEDSERVE_SERVER_TRACE_REQUESTS=1 logs one line per request when it ends
(service/api/generation.py, runtime/timeline.py). This splits each request's time to its first
token into stages, all in ms:

    admission   Generation made -> capacity and limits said yes (the front door's fair admission)
    handoff     admitted -> the engine thread queued it (the bridge's inbox, and the step running then)
    queue       queued -> the start of the step that computed its first prompt tokens
    first step  that step's own time (scheduling, forward, sampling); if its first token came later
                (a chunked prompt), the time to the end of the step that sampled it
    delivery    the end of that step -> the loop handed the token to its stream

and keeps, for the step that started it: how many sequences and tokens it held, how many were
decodes, and how many steps ran while it waited. `summarize` gives the percentiles per tenant.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import percentile

STAGES = ("admission", "handoff", "queue", "first_step", "delivery", "to_first_token")


def read_traces(log_path: Path, start: int = 0, end: int | None = None) -> list[dict]:
    """The server log's "request trace" records (JSON log lines), in order; only those between byte offsets
    `start` and `end` when given (a run's part of the log)."""
    traces = []
    with open(log_path, "rb") as f:
        f.seek(start)
        text = f.read(None if end is None else end - start).decode(errors="replace")
    for line in text.splitlines():
        if '"request trace"' not in line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == "request trace":
            traces.append(record)
    return traces


def stages(trace: dict) -> dict | None:
    """One trace's stages in ms (None when the engine's part is missing: a remote worker, or no token)."""
    engine = trace.get("engine")
    if not engine or engine.get("first_scheduled") is None or engine.get("first_token") is None:
        return None
    first, sampled = engine["first_scheduled"], engine["first_token"]
    sampled_end = sampled["started_ms"] + sampled["duration_ms"]
    admitted = trace["admitted_ms"] or 0.0
    return {
        "admission": admitted,
        "handoff": engine["queued_ms"] - (trace["submitted_ms"] or admitted),
        "queue": first["started_ms"] - engine["queued_ms"],
        "first_step": sampled_end - first["started_ms"],
        "delivery": (trace["delivered_ms"] or sampled_end) - sampled_end,
        "to_first_token": trace["delivered_ms"],
        "steps_waited": engine["num_steps_waited"],
        "step_seqs": first["num_seqs"],
        "step_tokens": first["num_tokens"],
        "step_decodes": first["num_decodes"],
        "step_waiting": first["num_waiting"],
    }


def summarize(traces: list[dict], tenant: str | None = None) -> dict:
    """Per tenant (or only `tenant`): p50 / p99 / max of each stage, and of the first step's shape."""
    by_tenant: dict[str, list[dict]] = {}
    for trace in traces:
        if tenant is not None and trace.get("tenant") != tenant:
            continue
        split = stages(trace)
        if split is not None:
            by_tenant.setdefault(trace["tenant"], []).append(split)
    out = {}
    for name, rows in by_tenant.items():
        keys = (*STAGES, "steps_waited", "step_seqs", "step_tokens", "step_decodes", "step_waiting")
        out[name] = {"requests": len(rows), **{
            key: {"p50": percentile([r[key] for r in rows], 0.5), "p99": percentile([r[key] for r in rows], 0.99),
                  "max": max(r[key] for r in rows)} for key in keys}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path)
    parser.add_argument("--tenant", default=None)
    args = parser.parse_args()
    summary = summarize(read_traces(args.log), args.tenant)
    for name, row in summary.items():
        print(f"tenant {name}: {row['requests']} requests")
        for key, value in row.items():
            if key != "requests":
                print(f"  {key:15s} p50 {value['p50']:9.1f}  p99 {value['p99']:9.1f}  max {value['max']:9.1f}")


if __name__ == "__main__":
    sys.exit(main())
