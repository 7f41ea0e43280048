"""Where the server's threads spend a tenant flood: py-spy over `pagedserve serve` during one phase of bench_tenant_flood.

    .venv/bin/python bench/profile_tenant_flood.py [tokenize|oversize] [NAME=VALUE ...]   # NAME=VALUE: server env

py-spy (`pip install py-spy`, on PATH or at $PYSPY) samples every thread at 200 Hz for 14 s while
the phase runs (10 s, after a 1 s head start). Written: bench/results/tenant_flood_profile_<phase>.txt
(py-spy's raw collapsed stacks, one line per stack and thread, with counts) and, on stdout, the
phase's figures and the top stacks per thread.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import bench_tenant_flood as flood
from common import RESULTS, free_port, log, start_process, stop_process, wait_http

from tests.service.conftest import write_tenants_file  # noqa: E402


def top_stacks(path: Path, num: int = 8) -> dict[str, list[tuple[int, str]]]:
    """Per thread, its most sampled stacks (the last 3 frames)."""
    threads: dict[str, Counter] = {}
    for line in path.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        name = frames[0].split(": ", 1)[-1]
        leaf = ";".join(frame.split(" (")[0] for frame in frames[-3:])
        threads.setdefault(name, Counter())[leaf] += int(count)
    return {name: [(n, s) for s, n in stacks.most_common(num)] for name, stacks in threads.items()}


def main() -> None:
    phase = sys.argv[1] if len(sys.argv) > 1 else "tokenize"
    env = dict(arg.split("=", 1) for arg in sys.argv[2:])
    pyspy = os.environ.get("PYSPY") or shutil.which("py-spy")
    if not pyspy:
        raise SystemExit("py-spy not found: pip install py-spy (or set PYSPY)")
    from smollm2 import gguf_file

    folder = Path(tempfile.mkdtemp(prefix="flood-profile-"))
    tenants = write_tenants_file(folder / "tenants.toml", {"a": {"keys": [flood.KEY_A], "plan": "standard"},
                                                           "b": {"keys": [flood.KEY_B], "plan": "standard"}})
    port = free_port()
    proc = start_process([sys.executable, "-m", "service.cli", "serve", "--model", str(gguf_file()), "--port",
                          str(port), "--data-dir", str(folder), "--tenants", str(tenants)], env=env,
                         log_path=folder / "server.log")
    url = f"http://127.0.0.1:{port}"
    out = RESULTS / f"tenant_flood_profile_{phase}.txt"
    try:
        wait_http(url + "/ready", proc, 300, folder / "server.log")
        log(f"profiling the {phase} phase into {out}")
        spy = subprocess.Popen([pyspy, "record", "--pid", str(proc.pid), "--threads", "--idle", "--format", "raw",
                                "-o", str(out), "--duration", "14", "--rate", "200", "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = flood._phase(url, phase, flood._flood_bodies(), asyncio.run(flood._served_model(url)), 10.0)
        spy.wait()
    finally:
        stop_process(proc)
    print(json.dumps({"phase": phase, "env": env, **result}))
    for thread, stacks in top_stacks(out).items():
        print(f"== {thread}")
        for count, stack in stacks:
            print(f"{count:6d} {stack}")


if __name__ == "__main__":
    main()
