"""A `python -m service.cli ...` process on 127.0.0.1 for the tests that need real server processes.

It logs JSON lines to a file in the test's folder; `wait_ready` polls its /ready. Given port 0
(`--port 0`), the server binds a free port itself and `wait_ready` reads it back from the line it
prints once it listens: no port is picked here and released before the server binds it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
_ANNOUNCED = re.compile(rb"(?:is serving .* at|probes at) http://[^:/\s]+:(\d+)")  # the lines a start prints


class Process:
    """One `python -m service.cli ...` process with a /ready probe on `port`."""

    def __init__(self, name: str, args: list[str], port: int, log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.port = port  # 0: the server's own choice, known once it listens (listening_port)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self._log_start = self._log.tell()  # this process's lines begin here (a restart appends to the same log)
        self.process = subprocess.Popen([sys.executable, "-m", "service.cli", *args], stdout=self._log,
                                        stderr=subprocess.STDOUT, cwd=REPO,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1", "PAGEDSERVE_SERVER_LOG_JSON": "true",
                                             **env})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def listening_port(self) -> int | None:
        """The port the process says it listens on, once it has said so: `serve`'s "is serving ... at URL" line
        and a worker's "probes at URL" line (printed whatever the log level), or a "listening" log line."""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            lines = log.read().splitlines()
        for line in lines:
            found = _ANNOUNCED.search(line)
            if found:
                return int(found.group(1))
            if b'"listening"' in line:
                try:
                    return int(json.loads(line)["url"].rsplit(":", 1)[1])
                except (ValueError, KeyError):
                    continue
        return None

    def wait_ready(self, timeout: float = 90.0, check=lambda body: True) -> dict:
        """Poll /ready until it answers 200 and `check(body)` holds; the body."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self.tail()}")
            if self.port == 0:
                self.port = self.listening_port() or 0
                if self.port == 0:
                    time.sleep(0.1)
                    continue
            try:
                response = requests.get(self.url + "/ready", timeout=1)
                if response.status_code == 200 and check(response.json()):
                    return response.json()
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or busy starting: poll on
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} was not ready within {timeout} s: {self.tail()}")

    def tail(self, num_bytes: int = 3000) -> str:
        return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL: nothing is flushed or unregistered on the way out."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
