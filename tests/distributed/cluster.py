"""Real processes on 127.0.0.1 for the Dynamo tests: `pagedserve worker`s and front doors."""

from __future__ import annotations

import time
from pathlib import Path

import requests

from tests.processes import Process


def start_worker(name: str, model: Path, discovery_dir: Path, log_dir: Path, *extra: str,
                 env: dict[str, str] | None = None) -> Process:
    """`pagedserve worker` on a probe port of its own choosing (read back from its log once it listens)."""
    args = ["worker", "--model", str(model), "--discovery-dir", str(discovery_dir), "--port", "0", *extra]
    return Process(name, args, 0, log_dir, env or {})


def start_front_door(model: Path, discovery_dir: Path, data_dir: Path, log_dir: Path, *extra: str,
                     env: dict[str, str] | None = None, name: str = "front-door") -> Process:
    """`pagedserve serve --router dynamo` on a port of its own choosing (read back from its log once it listens)."""
    args = ["serve", "--router", "dynamo", "--model", str(model), "--discovery-dir", str(discovery_dir),
            "--port", "0", "--data-dir", str(data_dir), *extra]
    return Process(name, args, 0, log_dir, env or {})


def worker_stats(worker: Process) -> dict:
    return requests.get(worker.url + "/stats", timeout=5).json()


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate()` until it returns something truthy; that value, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
