"""A `python -m service.cli ...` process on 127.0.0.1 for the tests that need real server processes.

It logs JSON lines to a file in the test's folder; `wait_ready` polls its /ready.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]


class Process:
    """One `python -m service.cli ...` process with a /ready probe on `port`."""

    def __init__(self, name: str, args: list[str], port: int, log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen([sys.executable, "-m", "service.cli", *args], stdout=self._log,
                                        stderr=subprocess.STDOUT, cwd=REPO,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1", "PAGEDSERVE_SERVER_LOG_JSON": "true",
                                             **env})

    def wait_ready(self, timeout: float = 90.0, check=lambda body: True) -> dict:
        """Poll /ready until it answers 200 and `check(body)` holds; the body."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self.tail()}")
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
