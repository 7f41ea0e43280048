"""Page tables: which pages each sequence reads and writes, on top of the block pool.

A sequence's page table covers its tokens in order; page i holds positions
[i * block_size, (i + 1) * block_size). Only the last page can be partial:

    tokens:      |0 ........ 15|16 ....... 31|32 .. 37 ......|
    page table:  [     p7      ,     p2      ,     p9         ]
                  full, hashed    full, hashed  partial: private

Full pages are hashed (chained, salted) once their K/V is scheduled to be computed, and can
then be shared by any sequence whose tokens start the same way, even one admitted later in
the same step: every layer writes the step's new K/V before any of its attention reads, so
identical prefixes that arrive together are computed once. A page with ref_count > 1 is read-only:
a sequence about to write into a shared partial page (a fork, n > 1) first copies it.
Allocation is check-then-commit: `can_allocate` says whether the pool can cover the
tokens about to be computed, `allocate` takes the pages. Pages are taken only for tokens
being computed now, so waste stays under one partial page per sequence.
"""

from __future__ import annotations

from runtime.block_hash import extend_block_hashes
from runtime.block_pool import Block, BlockPool, BlockPoolError
from runtime.kv_events import BlockStored
from runtime.request import Sequence


class KVCacheManager:
    """Per-sequence page tables, prefix lookups, copy-on-write forks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.block_tables: dict[str, list[Block]] = {}
        self.block_id_tables: dict[str, list[int]] = {}  # the same tables as ids, kept in step (the runner's input)
        self.num_hashed_blocks: dict[str, int] = {}  # leading pages of a table already offered to the cache
        self.pinned: dict[str, list[Block]] = {}  # pin id -> full pages held so they are never evicted

    # --- prefix cache -------------------------------------------------------------------

    def update_block_hashes(self, seq: Sequence) -> None:
        """Hash every full block of the sequence's tokens that is not hashed yet."""
        if self.enable_prefix_caching:
            request = seq.request
            extend_block_hashes(
                seq.block_hashes, seq.token_ids, self.block_size, request.cache_salt, request.num_shared_blocks
            )

    def find_cached_prefix(self, seq: Sequence) -> list[Block]:
        """The longest run of cached pages matching the sequence's first full blocks.

        At least the last token is always left to compute: its logits pick the next token.
        """
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Offer the pages full within the sequence's first `num_tokens` tokens to the prefix cache.

        The scheduler calls it with the tokens computed by the end of this step.
        """
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[seq.seq_id]
        num_full = num_tokens // self.block_size
        start = self.num_hashed_blocks[seq.seq_id]
        if num_full <= start:
            return
        self.update_block_hashes(seq)
        hashes, events = seq.block_hashes, self.pool.kv_events
        num_prompt_pages = seq.num_prompt_tokens // self.block_size
        for i in range(start, num_full):
            if self.pool.cache_full_block(table[i], hashes[i]):
                if i < num_prompt_pages:  # a page of the prompt written to the cache (Anthropic's cache creation)
                    seq.request.num_cache_written_tokens += self.block_size
                if events is not None:
                    events.append(self._stored_event(seq, i))
        self.num_hashed_blocks[seq.seq_id] = num_full

    def _stored_event(self, seq: Sequence, i: int) -> BlockStored:
        request = seq.request
        salt = request.cache_salt if i >= request.num_shared_blocks else None
        tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
        return BlockStored(seq.block_hashes[i], seq.block_hashes[i - 1] if i else None, tokens, salt,
                           salt_enters=salt is not None and i == request.num_shared_blocks)

    # --- allocation ---------------------------------------------------------------------

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: list[Block]) -> tuple[int, bool]:
        """(new pages to take, whether the write position's page must be copied first)."""
        table = self.block_tables.get(seq.seq_id, [])
        num_computed = len(cached) * self.block_size if cached else seq.num_computed_tokens
        num_pages_after = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_pages = max(0, num_pages_after - len(table) - len(cached))
        write_page = num_computed // self.block_size
        needs_copy = (
            not cached
            and num_computed % self.block_size != 0
            and write_page < len(table)
            and table[write_page].ref_count > 1
        )
        return num_new_pages, needs_copy

    def _fits(self, num_new_pages: int, needs_copy: bool, cached: list[Block]) -> bool:
        num_revived = sum(1 for block in cached if block.ref_count == 0)  # leave the free queue
        return num_new_pages + int(needs_copy) + num_revived <= self.pool.num_free_blocks

    def has_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the sequence's own pages already hold its next tokens (most decodes): no allocation."""
        table = self.block_tables.get(seq.seq_id)
        end = seq.num_computed_tokens + num_new_tokens
        if table is None or end > len(table) * self.block_size:
            return False
        return table[seq.num_computed_tokens // self.block_size].ref_count == 1

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[Block] = (), reserve: int = 0) -> bool:
        """Whether the pool can hold `num_new_tokens` more tokens of `seq` (after `cached`), with `reserve` pages
        left over for others."""
        cached = list(cached)
        num_new_pages, needs_copy = self._blocks_needed(seq, num_new_tokens, cached)
        return self._fits(num_new_pages + reserve, needs_copy, cached)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[Block] = ()) -> list[tuple[int, int]]:
        """Take the pages for `num_new_tokens` more tokens; returns (src, dst) page copies to run first.

        With `cached` (a prefix hit, only for a sequence with no pages yet), the hit pages
        gain a reader and the sequence's computed count jumps past them.
        """
        cached = list(cached)
        num_new_pages, needs_copy = self._blocks_needed(seq, num_new_tokens, cached)
        if not self._fits(num_new_pages, needs_copy, cached):
            raise BlockPoolError(f"cannot allocate {num_new_tokens} tokens for {seq}")
        table = self.block_tables.setdefault(seq.seq_id, [])
        ids = self.block_id_tables.setdefault(seq.seq_id, [])
        self.num_hashed_blocks.setdefault(seq.seq_id, 0)
        if cached:
            if table or seq.num_computed_tokens:
                raise BlockPoolError(f"prefix hit for {seq}, which already has pages")
            self.pool.touch(cached)
            table.extend(cached)
            ids.extend(block.block_id for block in cached)
            self.num_hashed_blocks[seq.seq_id] = len(cached)
            seq.num_computed_tokens = len(cached) * self.block_size
        copies = []
        if needs_copy:
            write_page = seq.num_computed_tokens // self.block_size
            shared = table[write_page]
            private = self.pool.get_new_blocks(1)[0]
            table[write_page] = private
            ids[write_page] = private.block_id
            self.pool.free_blocks([shared])
            copies.append((shared.block_id, private.block_id))
        new_blocks = self.pool.get_new_blocks(num_new_pages)
        table.extend(new_blocks)
        ids.extend(block.block_id for block in new_blocks)
        return copies

    def trim(self, seq: Sequence) -> None:
        """Return the pages wholly past the sequence's tokens: written only by drafts that were rejected.

            tokens:  | ... p3: 14 15 [16] | p4: d d d  |     [16]: the last token, computed next step
            kept:      p0 .. p3                          p4 held rejected drafts only: freed
        """
        table = self.block_tables[seq.seq_id]
        keep = -(-seq.num_tokens // self.block_size)
        if len(table) <= keep:
            return
        extra = table[keep:]
        del table[keep:]
        del self.block_id_tables[seq.seq_id][keep:]
        self.pool.free_blocks(reversed(extra))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's page table; every page gains a reader."""
        table = self.block_tables[parent.seq_id]
        self.pool.touch(table)
        self.block_tables[child.seq_id] = list(table)
        self.block_id_tables[child.seq_id] = list(self.block_id_tables[parent.seq_id])
        self.num_hashed_blocks[child.seq_id] = self.num_hashed_blocks[parent.seq_id]

    def free(self, seq: Sequence) -> None:
        """Return the sequence's pages, tail first, so its tail is evicted before its shared head."""
        table = self.block_tables.pop(seq.seq_id, [])
        self.block_id_tables.pop(seq.seq_id, None)
        self.num_hashed_blocks.pop(seq.seq_id, None)
        self.pool.free_blocks(reversed(table))

    # --- pinned prefixes ----------------------------------------------------------------

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.pinned.values())

    def pin(self, pin_id: str, seq: Sequence) -> int:
        """Hold the sequence's computed full pages under `pin_id` (one more reader each); returns their count."""
        self.unpin(pin_id)
        full = self.block_tables[seq.seq_id][: seq.num_computed_tokens // self.block_size]
        self.pool.touch(full)
        self.pinned[pin_id] = list(full)
        return len(full)

    def unpin(self, pin_id: str) -> bool:
        """Let go of a pin's pages (they stay cached until evicted)."""
        blocks = self.pinned.pop(pin_id, None)
        if blocks is None:
            return False
        self.pool.free_blocks(reversed(blocks))
        return True

    def block_ids(self, seq: Sequence) -> list[int]:
        """The sequence's page table as block ids (the manager's own list: read, do not change)."""
        return self.block_id_tables[seq.seq_id]

    def check_invariants(self) -> None:
        """The pool's invariants, plus: every page in a table is in use, as often as tables list it."""
        self.pool.check_invariants()
        if self.block_id_tables.keys() != self.block_tables.keys():
            raise BlockPoolError("the id tables and the block tables list different sequences")
        for seq_id, table in self.block_tables.items():
            if self.block_id_tables[seq_id] != [block.block_id for block in table]:
                raise BlockPoolError(f"the id table of {seq_id} differs from its blocks")
        readers: dict[int, int] = {}
        for table in [*self.block_tables.values(), *self.pinned.values()]:
            for block in table:
                readers[block.block_id] = readers.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            if block.ref_count != readers.get(block.block_id, 0):
                raise BlockPoolError(
                    f"{block} is listed in {readers.get(block.block_id, 0)} page tables and pins"
                )
