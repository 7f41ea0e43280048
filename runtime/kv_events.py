"""Prefix-cache events: which full blocks a worker's cache gained and lost, in order.

Routers that score workers by cached prefix (the service's prefix index, Dynamo's KV router,
vLLM-format event consumers) rebuild each worker's cache from these. A stored block carries
what a router needs to place it without asking the worker: its tokens, its parent's hash
and the salt its chain is under (None for a block of an operator-shared prefix, which every
tenant reads).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block entered the prefix cache."""

    block_hash: bytes  # chained and salted (runtime.block_hash)
    parent_hash: bytes | None  # the previous block's hash; None for a prompt's first block
    token_ids: tuple[int, ...]  # the block's block_size tokens
    salt: bytes | None  # the tenant salt of its chain; None for a shared-prefix block (no salt)
    salt_enters: bool = False  # the salt enters the chain's hash at this block (the chain's first salted block)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block left the prefix cache (evicted); its page is being reused."""

    block_hash: bytes


KVEvent = BlockStored | BlockRemoved


def net_hashes(events: list[KVEvent]) -> tuple[list[bytes], list[bytes]]:
    """(hashes cached, hashes evicted) after applying `events` in order; each list deduplicated.

    A hash stored then removed counts as removed, and removed then stored as stored.
    """
    stored: dict[bytes, None] = {}
    removed: dict[bytes, None] = {}
    for event in events:
        cached = isinstance(event, BlockStored)
        (stored if cached else removed)[event.block_hash] = None
        (removed if cached else stored).pop(event.block_hash, None)
    return list(stored), list(removed)


def event_runs(events: list[KVEvent]) -> list[list[KVEvent]]:
    """`events` in order, cut into runs a router takes as one message each: consecutive
    removals, or consecutive stored blocks of one chain under one salt (each block's parent
    is the block before it). This is how vLLM reports a prefill: one event per run."""
    runs: list[list[KVEvent]] = []
    for event in events:
        last = runs[-1][-1] if runs else None
        if isinstance(event, BlockRemoved):
            joins = isinstance(last, BlockRemoved)
        else:
            joins = isinstance(last, BlockStored) and event.parent_hash == last.block_hash and event.salt == last.salt
        if joins:
            runs[-1].append(event)
        else:
            runs.append([event])
    return runs
