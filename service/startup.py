"""Starting a process all or nothing: what is checked before anything is announced, and how a failed start exits.

Every command that serves (`serve`, `serve --router dynamo`, `worker`) first takes its port
and checks its model path and discovery folder, so the common mistakes fail in a second,
before a model loads or anything registers with Dynamo. Any start-up failure ends the
process with exit status 1 and one line on stderr naming the cause, never a traceback
(that goes to the log at debug level).
"""

from __future__ import annotations

import errno
import gc
import os
import socket
import sys
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

EXIT_STARTUP_FAILED = 1


class StartupError(Exception):
    """A start-up failure with the one line an operator should read."""


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound (not yet listening) to host:port, so the port is ours before any slow start-up.

    Port 0 takes a free port (read it back with `bound_port`). Raises StartupError naming the
    port when it is taken or not allowed.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds: TIME_WAIT does not block
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise _port_in_use(host, port) from exc
        if exc.errno == errno.EADDRNOTAVAIL:
            raise StartupError(f"cannot bind {host}:{port}: {host} is not an address of this machine") from exc
        raise StartupError(f"cannot bind {host}:{port}: {exc.strerror or exc}") from exc
    return sock


def _port_in_use(host: str, port: int) -> StartupError:
    return StartupError(f"port {port} on {host} is already in use (another server or worker holds it); "
                        "pass a free --port, or --port 0 for any free one")


def bound_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]


def check_model_path(model: str) -> None:
    """The model must be 'demo', an existing folder or a .gguf file; StartupError naming the path otherwise."""
    if model == "demo":
        return
    path = Path(model)
    if not path.exists():
        raise StartupError(f"model path {model} does not exist (a Hugging Face checkpoint folder, a .gguf file, "
                           "or 'demo')")
    if path.is_file() and not path.name.lower().endswith(".gguf"):
        raise StartupError(f"model path {model} is a file but not a .gguf file (expected a Hugging Face checkpoint "
                           "folder or a GGUF file)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise StartupError(f"model path {model} has no config.json (expected a Hugging Face checkpoint folder)")


def check_discovery_dir(discovery_dir: str) -> Path:
    """Dynamo's discovery folder must exist (it is created) and be writable; its resolved path."""
    folder = Path(discovery_dir).resolve()
    probe = folder / f".pagedserve-write-check-{uuid.uuid4().hex}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StartupError(f"the discovery folder {folder} is not writable: {exc.strerror or exc} "
                           "(set --discovery-dir to a folder every process of the cluster can write)") from exc
    return folder


def preflight(host: str, port: int, model: str | None, discovery_dir: str | None) -> socket.socket:
    """The checks every serving command makes before anything slow: its port (bound, returned), then
    the model path (None: a custom engine factory, not checked) and the discovery folder (None: not
    behind Dynamo). Raises StartupError, with the port released, on the first that fails."""
    sock = bind_port(host, port)
    try:
        if model is not None:
            check_model_path(model)
        if discovery_dir is not None:
            check_discovery_dir(discovery_dir)
    except BaseException:
        sock.close()
        raise
    return sock


async def close_quietly(*closers: Callable[[], Coroutine]) -> None:
    """Await each closer after a failed start, logging (not raising) what fails: the start's error is what counts."""
    for close in closers:
        try:
            await close()
        except Exception as exc:
            log.warning("cleanup after a failed start failed", error=repr(exc))


def describe_failure(exc: BaseException) -> str:
    """The one line for a start-up failure: a StartupError's own, else what raised and why."""
    if isinstance(exc, StartupError):
        return str(exc)
    message = str(exc) or type(exc).__name__
    return f"{message} ({type(exc).__name__})"


def as_startup_error(exc: BaseException, host: str | None = None, port: int | None = None) -> StartupError:
    """Any exception raised while starting, as the StartupError that ends the process with one line.

    An address-in-use error names `host:port` (two processes can both bind before either listens).
    """
    if isinstance(exc, StartupError):
        return exc
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE and port is not None:
        return _port_in_use(host or "", port)
    log.debug("start-up failed", exc_info=exc)  # the traceback, for --log-level debug
    error = StartupError(describe_failure(exc))
    error.__cause__ = exc
    return error


def freeze_startup_heap() -> int:
    """Move every object alive after start-up (the model, modules, the app: ~220,000 for SmolLM2) out of the
    garbage collector's reach; returns how many.

    A full collection walks every tracked object while holding the GIL: 107 ms at start-up size, and
    the engine thread waits for the GIL between operations, so each one is a step 107 ms late. A
    tenant whose requests allocate much (a flood of refused megabyte chats) set them off every few
    seconds. Objects made before this call live as long as the process; what is made later is
    collected as before.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen", objects=frozen)
    return frozen


def run_until_stopped(main: Callable[[], Coroutine], name: str) -> int:
    """Run `main()` on uvloop; a StartupError prints one line and leaves with EXIT_STARTUP_FAILED.

    A failed start leaves through os._exit once stderr is flushed: Dynamo's runtime threads,
    if any were started, must not meet the interpreter's shutdown (a C++ "exception not
    rethrown" abort). What they registered was removed before the error got here.
    """
    import uvloop

    try:
        uvloop.run(main())
    except StartupError as exc:
        print(f"error: {name} did not start: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_STARTUP_FAILED)
    return 0
