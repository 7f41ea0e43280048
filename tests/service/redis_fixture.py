"""A real redis-server on a Unix socket (no TCP port to race for), with AOF on, for the storage tests.

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
import tempfile
import time
from pathlib import Path

import pytest


def redis_server_binary() -> str:
    """redis-server from PATH; a clear failure naming the fix when it is missing."""
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail("redis-server is not on PATH: run `make setup` (scripts/system-deps.sh installs it)", pytrace=False)
    return found


def _command(socket_path: Path, *words: str, timeout: float = 1.0) -> bytes:
    """Send one inline command, return the first reply line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(socket_path))
        s.sendall(" ".join(words).encode() + b"\r\n")
        return s.makefile("rb").readline().rstrip(b"\r\n")


class RedisServer:
    """One redis-server process: --save "" --appendonly yes --appendfsync everysec, data in `dir`.

    It listens on a Unix socket only (--port 0): the socket's path is this server's own, kept across
    restarts, so no other process can take its address between a pick and a bind. The path lives in a
    short folder under the system's temp dir (a socket path has at most 107 bytes; pytest's are longer).
    """

    def __init__(self, dir: str | Path) -> None:
        self.dir = Path(dir)
        self.socket_path = Path(tempfile.mkdtemp(prefix="redis-")) / "redis.sock"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}?db=0"

    def start(self, timeout: float = 10.0) -> None:
        """Launch and wait until it answers PING with PONG (after loading its AOF)."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"redis-server on {self.socket_path} is already running")
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "redis.log", "ab")
        self.process = subprocess.Popen(
            [redis_server_binary(), "--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.dir)],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self.dir / 'redis.log'}")
            try:
                if _command(self.socket_path, "PING") == b"+PONG":
                    return
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on {self.socket_path} did not answer PING within {timeout} s")

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
        """Stop if running, then start on the same socket and dir (the AOF is replayed)."""
        self.stop()
        self.start()

    def flushall(self) -> None:
        if _command(self.socket_path, "FLUSHALL", "SYNC") != b"+OK":
            raise RuntimeError("FLUSHALL failed")

    def remove_socket_dir(self) -> None:
        shutil.rmtree(self.socket_path.parent, ignore_errors=True)


def start_server(dir: Path) -> RedisServer:
    """A started server with its data in `dir`."""
    server = RedisServer(dir)
    server.start()
    return server


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
    server.remove_socket_dir()


@pytest.fixture
def redis_url(redis_server) -> str:
    redis_server.flushall()
    return redis_server.url


@pytest.fixture
def own_redis_server(tmp_path):
    server = start_server(tmp_path / "redis")
    yield server
    server.kill()
    server.remove_socket_dir()
