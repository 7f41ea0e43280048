"""A worker's prefix-cache events, published to Dynamo's KV router (KvEventPublisher).

Dynamo's indexer keeps, per worker, a radix tree of blocks keyed by the hash of each block's
tokens under its cache salt, and names blocks by the worker's own 64-bit ids. So a stored
block goes out with its tokens, its id (`block_hash_i64` of our hash), its parent's id and
the salt of its chain; a removed block by its id. Consecutive blocks of one chain go out as
one stored event, the way vLLM's engine reports a prefill.
"""

from __future__ import annotations

from runtime.kv_events import BlockRemoved, KVEvent
from service.distributed.dynamo_runtime import block_hash_i64, import_dynamo


def dynamo_event_batch(events: list[KVEvent], block_size: int) -> list[dict]:
    """The engine's events (in order) as KvEventPublisher.publish_batch inputs."""
    batch: list[dict] = []
    last: dict | None = None  # the stored input the next block may extend
    last_hash: bytes | None = None
    for event in events:
        if isinstance(event, BlockRemoved):
            if batch and batch[-1]["type"] == "removed":
                batch[-1]["block_hashes"].append(block_hash_i64(event.block_hash))
            else:
                batch.append({"type": "removed", "block_hashes": [block_hash_i64(event.block_hash)]})
            last = None
            continue
        salt = event.salt.hex() if event.salt is not None else None
        if last is not None and event.parent_hash == last_hash and last.get("cache_salt") == salt:
            last["token_ids"] += event.token_ids
            last["num_block_tokens"].append(block_size)
            last["block_hashes"].append(block_hash_i64(event.block_hash))
        else:
            last = {"type": "stored", "token_ids": list(event.token_ids), "num_block_tokens": [block_size],
                    "block_hashes": [block_hash_i64(event.block_hash)]}
            if event.parent_hash is not None:
                last["parent_hash"] = block_hash_i64(event.parent_hash)
            if salt is not None:
                last["cache_salt"] = salt
            batch.append(last)
        last_hash = event.block_hash
    return batch


class DynamoKvPublisher:
    """Sends each step's events to Dynamo's router (call `publish` on the worker's loop)."""

    def __init__(self, endpoint, block_size: int) -> None:
        self._publisher = import_dynamo().KvEventPublisher(endpoint, kv_block_size=block_size)
        self.block_size = block_size

    def publish(self, events: list[KVEvent]) -> None:
        batch = dynamo_event_batch(events, self.block_size)
        if batch:
            self._publisher.publish_batch(batch)

    def close(self) -> None:
        self._publisher.shutdown()
