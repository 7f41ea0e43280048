"""A real redis-server on a free loopback port, with AOF on, for the storage tests.

Import the fixtures into a test module:

    from tests.service.redis_fixture import redis_server, redis_url  # noqa: F401

`redis_server` is one server per test module; `redis_url` is its URL after a FLUSHALL, so
every test starts from an empty Redis. `own_redis_server` is a server for one test alone
(for tests that kill it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

def redis_server_binary() -> str:
    """redis-server from PATH; a clear failure naming the fix when it is missing."""
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail("redis-server is not on PATH: run `make setup` (scripts/system-deps.sh installs it)", pytrace=False)
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(port: int, *words: str, timeout: float = 1.0) -> bytes:
    """Send one inline command, return the first reply line."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(" ".join(words).encode() + b"\r\n")
        return s.makefile("rb").readline().rstrip(b"\r\n")


class RedisServer:
    """One redis-server process: --save "" --appendonly yes --appendfsync everysec, data in `dir`."""

    def __init__(self, port: int, dir: str | Path) -> None:
        self.port = port
        self.dir = Path(dir)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Launch and wait until it answers PING with PONG (after loading its AOF)."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "redis.log", "ab")
        self.process = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.dir)],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self.dir / 'redis.log'}")
            try:
                if _command(self.port, "PING") == b"+PONG":
                    return
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout} s")

    def stop(self) -> None:
        """Terminate cleanly (SIGTERM: Redis flushes its AOF) and wait."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed on the way out."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def restart(self) -> None:
        """Stop if running, then start on the same port and dir (the AOF is replayed)."""
        self.stop()
        self.start()

    def flushall(self) -> None:
        if _command(self.port, "FLUSHALL", "SYNC") != b"+OK":
            raise RuntimeError("FLUSHALL failed")


def start_server(dir: Path) -> RedisServer:
    """A started server on a free port (a few tries: another process may take the port first)."""
    for _ in range(2):
        server = RedisServer(free_port(), dir)
        try:
            server.start()
            return server
        except RuntimeError:
            pass
    server = RedisServer(free_port(), dir)
    server.start()
    return server


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    redis_server.flushall()
    return redis_server.url


@pytest.fixture
def own_redis_server(tmp_path):
    server = start_server(tmp_path / "redis")
    yield server
    server.kill()
