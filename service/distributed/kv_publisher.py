"""A worker's prefix-cache events, published to Dynamo's KV router (KvEventPublisher).

Dynamo's indexer keeps, per worker, a radix tree of blocks keyed by the hash of each block's
tokens under its cache salt, and names blocks by the worker's own 64-bit ids. So a stored
block goes out with its tokens, its id (`block_hash_i64` of our hash), its parent's id and
the salt of its chain; a removed block by its id. Consecutive blocks of one chain go out as
one stored event, the way vLLM's engine reports a prefill.
"""

from __future__ import annotations

from runtime.kv_events import BlockRemoved, KVEvent, event_runs
from service.distributed.dynamo_runtime import block_hash_i64, import_dynamo


def dynamo_event_batch(events: list[KVEvent], block_size: int) -> list[dict]:
    """The engine's events (in order) as KvEventPublisher.publish_batch inputs, one per run."""
    batch = []
    for run in event_runs(events):
        hashes = [block_hash_i64(event.block_hash) for event in run]
        if isinstance(run[0], BlockRemoved):
            batch.append({"type": "removed", "block_hashes": hashes})
            continue
        first = run[0]
        stored = {"type": "stored", "token_ids": [t for event in run for t in event.token_ids],
                  "num_block_tokens": [block_size] * len(run), "block_hashes": hashes}
        if first.parent_hash is not None:
            stored["parent_hash"] = block_hash_i64(first.parent_hash)
        if first.salt is not None:
            stored["cache_salt"] = first.salt.hex()
        batch.append(stored)
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
