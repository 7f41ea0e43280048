"""The block pool: every physical KV page, its reference count, and the prefix-cache map.

A page (block) holds `block_size` token slots in every layer's K and V cache. The pool
never grows. A page is in exactly one of three states:

    in use         ref_count > 0, listed in at least one page table
    cached-free    ref_count == 0, holds a hashed full block: reusable on a prefix hit,
                   evicted (hash dropped) when handed out as a new page
    free           ref_count == 0, no hash

Both ref_count-0 states live in `free_queue`, a doubly linked list that is also the LRU of
cached-free pages: new pages come from its head (oldest first), freed pages go to its tail,
and a prefix hit takes a cached-free page out of its middle in O(1).
"""

from __future__ import annotations

from collections.abc import Iterable

from runtime.kv_events import BlockRemoved, KVEvent


class BlockPoolError(RuntimeError):
    """The pool was asked for something it cannot do, or its bookkeeping is inconsistent."""


class Block:
    """One physical page: its id, how many page tables hold it, and its prefix hash if full."""

    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of ref_count-0 pages: popleft, append and remove are O(1)."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels: head.next_free is the oldest page
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        """Put `block` at the tail (most recently freed, evicted last)."""
        if block.prev_free is not None or block.next_free is not None:
            raise BlockPoolError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_blocks += 1

    def remove(self, block: Block) -> None:
        """Take `block` out of the queue wherever it is."""
        if block.prev_free is None or block.next_free is None:
            raise BlockPoolError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def popleft(self) -> Block:
        """Take the oldest page."""
        first = self._head.next_free
        if first is self._tail:
            raise BlockPoolError("no free block")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def block_ids(self) -> list[int]:
        """Ids in queue order, head (next to hand out) first."""
        return [block.block_id for block in self]


class BlockPool:
    """All pages of the KV cache, handed out and taken back by reference count."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise BlockPoolError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.hash_to_block: dict[bytes, Block] = {}
        self.num_evictions = 0
        self.kv_events: list[KVEvent] | None = None  # when recording: removals here, stores by the KV manager

    @property
    def num_free_blocks(self) -> int:
        """Pages with ref_count 0, cached or not: what can be handed out right now."""
        return self.free_queue.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Pages holding a hashed full block, in use or not."""
        return len(self.hash_to_block)

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Hand out `num_blocks` pages from the head of the free queue, evicting their hashes."""
        if num_blocks > self.num_free_blocks:
            raise BlockPoolError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            new_blocks.append(block)
        return new_blocks

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        """The page holding the block with this hash, if any."""
        return self.hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reader to each page (a prefix hit or a fork); a ref_count-0 page leaves the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop a reader from each page, in the order given; a page reaching 0 joins the tail."""
        for block in blocks:
            if block.ref_count <= 0:
                raise BlockPoolError(f"freeing {block}, which is not in use")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: Block, block_hash: bytes) -> bool:
        """Record that `block` holds the full block `block_hash`; False if another page already does."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.hash_to_block:
            return False  # same content computed twice at once: the first copy stays canonical
        block.block_hash = block_hash
        self.hash_to_block[block_hash] = block
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self.hash_to_block.get(block.block_hash) is not block:
            raise BlockPoolError(f"{block} is hashed but not in hash_to_block")
        del self.hash_to_block[block.block_hash]
        if self.kv_events is not None:
            self.kv_events.append(BlockRemoved(block.block_hash))
        block.block_hash = None
        self.num_evictions += 1

    def check_invariants(self) -> None:
        """Raise BlockPoolError unless the pool's bookkeeping adds up."""
        in_queue = list(self.free_queue)
        if len(in_queue) != self.free_queue.num_blocks:
            raise BlockPoolError("free queue length disagrees with its counter")
        if len({b.block_id for b in in_queue}) != len(in_queue):
            raise BlockPoolError("a block is in the free queue twice")
        num_in_use = 0
        for block in self.blocks:
            if block.ref_count < 0:
                raise BlockPoolError(f"{block} has a negative ref_count")
            queued = block.prev_free is not None
            if block.ref_count == 0 and not queued:
                raise BlockPoolError(f"{block} has ref_count 0 but is not in the free queue")
            if block.ref_count > 0:
                num_in_use += 1
                if queued:
                    raise BlockPoolError(f"{block} is in use and in the free queue")
            if block.block_hash is not None and self.hash_to_block.get(block.block_hash) is not block:
                raise BlockPoolError(f"{block} is hashed but not mapped to itself")
        if num_in_use + len(in_queue) != self.num_blocks:
            raise BlockPoolError("free + in use != total")
        for block_hash, block in self.hash_to_block.items():
            if block.block_hash != block_hash:
                raise BlockPoolError(f"hash_to_block maps a hash to {block}, which holds another")
