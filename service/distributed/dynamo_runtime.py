"""Starting NVIDIA Dynamo's runtime for pagedserve (the `ai-dynamo-runtime` package, 1.6.x).

Discovery is Dynamo's file backend (a folder every process of the cluster sees: local disk
on one host, a shared volume across hosts), requests and responses go over TCP, and KV
events over ZMQ: no etcd and no NATS. Each process advertises the address it binds, set by
`host` (127.0.0.1 on one host; the pod or machine address in a cluster).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

WORKER_COMPONENT = "worker"
GENERATE_ENDPOINT = "generate"

# the variables Dynamo reads for the addresses it binds and advertises, and for file discovery
_HOST_VARIABLES = ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST")


def import_dynamo():
    """The `dynamo._core` module, or a RuntimeError that says how to install it."""
    try:
        from dynamo import _core
    except ImportError as exc:
        raise RuntimeError("the Dynamo router needs the optional extra: pip install 'pagedserve[dynamo]' "
                           f"(ai-dynamo-runtime); import failed: {exc}") from exc
    return _core


def endpoint_path(namespace: str) -> str:
    """Where workers serve: `{namespace}.worker.generate`."""
    return f"{namespace}.{WORKER_COMPONENT}.{GENERATE_ENDPOINT}"


def create_runtime(loop: asyncio.AbstractEventLoop, discovery_dir: str | Path, host: str | None = None):
    """A DistributedRuntime on file discovery in `discovery_dir`, TCP requests, ZMQ events.

    `host` (default: $PAGEDSERVE_ADVERTISE_HOST, else 127.0.0.1) is the address this process
    binds and advertises; Dynamo's own host variables, if already set, win.
    """
    core = import_dynamo()
    folder = Path(discovery_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["DYN_FILE_KV"] = str(folder)  # the setting decides, not an inherited variable
    os.environ.setdefault("DYN_LOG", "warn")  # Dynamo's Rust side logs every routed call at info
    address = host or os.environ.get("PAGEDSERVE_ADVERTISE_HOST", "127.0.0.1")
    for name in _HOST_VARIABLES:
        os.environ.setdefault(name, address)
    return core.DistributedRuntime(loop, "file", "tcp", event_plane="zmq")


def block_hash_i64(block_hash: bytes) -> int:
    """Our 32-byte block hash as the signed 64-bit id Dynamo's KV events name a block by."""
    return int.from_bytes(block_hash[:8], "little", signed=True)


def routing_namespace(cache_salt: bytes | None, num_shared_blocks: int) -> str | None:
    """The cache namespace Dynamo's router hashes a request's blocks under.

    Dynamo hashes every block of a query under one namespace, while our chain is unsalted for
    an operator-shared prefix and salted after it. A request that starts with a shared prefix
    is routed by the unsalted namespace: the shared blocks (the long system prompt) match,
    the tenant's own blocks after them never do. That can miss a hit, never claim another
    tenant's pages.
    """
    if cache_salt is None or num_shared_blocks > 0:
        return None
    return cache_salt.hex()
