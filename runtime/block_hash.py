"""Chained, salted hashes of full KV blocks: the prefix cache's keys.

    h_0 = H(ROOT, tokens of block 0, salt)
    h_i = H(h_{i-1}, tokens of block i)

A block's hash names its whole prefix, so equal hashes mean equal K/V. The salt (the
tenant's cache salt) enters the first block only, which separates whole chains. H is
blake2b with a 32-byte digest, never Python's hash().
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"pagedserve-prefix-root-v1"


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], salt: bytes | None = None) -> bytes:
    """Hash one full block given its parent's hash (None for block 0) and, for block 0, the salt."""
    hasher = hashlib.blake2b(digest_size=32)
    hasher.update(ROOT_HASH if parent_hash is None else parent_hash)
    hasher.update(len(token_ids).to_bytes(4, "little"))
    hasher.update(array("q", token_ids).tobytes())
    if parent_hash is None:
        salt = salt or b""
        hasher.update(len(salt).to_bytes(4, "little"))
        hasher.update(salt)
    return hasher.digest()


def extend_block_hashes(
    block_hashes: list[bytes], token_ids: Sequence[int], block_size: int, salt: bytes | None
) -> None:
    """Append to `block_hashes` the hashes of the full blocks of `token_ids` not yet hashed."""
    num_full_blocks = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[i - 1] if i else None
        block_hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt))
