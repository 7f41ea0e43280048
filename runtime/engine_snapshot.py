"""What the engine shows of itself: counters for the metrics and a page map for the dashboard.

Both are plain data taken on the engine thread (between steps) and handed to the loop: lists
are copies, never the engine's live ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.speculative.draft_model import DraftModelProposer

if TYPE_CHECKING:
    from runtime.engine import Engine


def engine_stats(engine: Engine) -> dict:
    """Page and queue counters (the names the metrics and the dashboard use)."""
    pool = engine.kv.pool
    return {
        "block_size": engine.block_size,
        "num_blocks": engine.num_blocks,
        "num_free_blocks": pool.num_free_blocks,
        "num_used_blocks": engine.num_blocks - pool.num_free_blocks,
        "num_cached_blocks": pool.num_cached_blocks,
        "num_kv_tokens": _num_kv_tokens(engine),
        "num_running": len(engine.scheduler.running),
        "num_waiting": len(engine.scheduler.waiting),
        "num_preemptions": engine.scheduler.num_preemptions,
        "prefix_cache_queries": engine.scheduler.prefix_cache_queries,
        "prefix_cache_hits": engine.scheduler.prefix_cache_hits,
        "num_pinned_blocks": engine.kv.num_pinned_blocks,
        "spec_decode_num_drafts": engine.speculator.stats.num_drafts,
        "spec_decode_num_draft_tokens": engine.speculator.stats.num_draft_tokens,
        "spec_decode_num_accepted_tokens": engine.speculator.stats.num_accepted_tokens,
        "spec_decode_accepted_per_position": list(engine.speculator.stats.accepted_per_position),
        **_draft_stats(engine),
        "scheduling": engine.scheduler.policy.name,
        "tenants": engine.scheduler.tenant_stats(),
    }


def _draft_stats(engine: Engine) -> dict:
    draft = engine.speculator.proposer
    if not isinstance(draft, DraftModelProposer):
        return {}
    return {"draft_num_blocks": draft.num_blocks, "draft_num_used_blocks": draft.num_used_blocks,
            "draft_num_skipped_for_pages": draft.num_skipped_for_pages}


def page_map(engine: Engine) -> dict:
    """A snapshot of every page and every live sequence's page table (the dashboard's picture).

    blocks: parallel lists over block ids: ref_count, cached (holds a hashed full block),
    owner (index into `sequences` of the first live sequence listing it, -1 if none).
    sequences: each live sequence's ids, progress and block table (logical -> physical).
    contiguous_max_len_tokens: what reserving max_model_len slots per live sequence
    would take right now, for comparison with the pages actually in use.
    """
    pool = engine.kv.pool
    sequences = []
    owner = [-1] * engine.num_blocks
    live = [*engine.scheduler.running, *(s for s in engine.scheduler.waiting if s.seq_id in engine.kv.block_tables)]
    for i, seq in enumerate(live):
        drafting = engine.speculator.drafting(seq.seq_id)
        table = list(engine.kv.block_ids(seq))  # a snapshot: it crosses to the loop
        for block_id in table:
            if owner[block_id] == -1:
                owner[block_id] = i
        sequences.append({
            "seq_id": seq.seq_id, "request_id": seq.request.request_id, "status": seq.status.value,
            "num_prompt_tokens": seq.num_prompt_tokens, "num_tokens": seq.num_tokens,
            "num_computed_tokens": seq.num_computed_tokens,
            "max_tokens": seq.params.max_tokens, "block_table": table,
            "num_draft_tokens": drafting.num_draft_tokens, "num_accepted_draft_tokens": drafting.num_accepted_tokens,
        })
    return {
        "block_size": engine.block_size,
        "num_blocks": engine.num_blocks,
        "ref_count": [b.ref_count for b in pool.blocks],
        "cached": [int(b.block_hash is not None) for b in pool.blocks],
        "owner": owner,
        "sequences": sequences,
        "pinned": {pin_id: [b.block_id for b in blocks] for pin_id, blocks in engine.kv.pinned.items()},
        "num_waiting": len(engine.scheduler.waiting),
        "contiguous_max_len_tokens": len(live) * engine.max_model_len,
        "stats": engine_stats(engine),
    }


def _num_kv_tokens(engine: Engine) -> int:
    """Token slots holding K/V of live sequences, each shared page counted once."""
    filled: dict[int, int] = {}
    for seq in engine.scheduler.running:
        for i, block_id in enumerate(engine.kv.block_ids(seq)):
            slots = max(0, min(engine.block_size, seq.num_computed_tokens - i * engine.block_size))
            filled[block_id] = max(filled.get(block_id, 0), slots)
    return sum(filled.values())
