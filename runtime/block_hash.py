"""Chained, salted hashes of full KV blocks: the prefix cache's keys.

    h_0 = H(ROOT, tokens of block 0, salt)
    h_i = H(h_{i-1}, tokens of block i)

A block's hash names its whole prefix, so equal hashes mean equal K/V. The salt (the
tenant's cache salt) enters the first block only, which separates whole chains. H is
blake2b with a 32-byte digest, never Python's hash().

A prefix an operator marked as shared across tenants (k full blocks) is hashed with the
empty salt, and the tenant's salt enters at block k instead, so the shared blocks are one
chain for everyone and every block after them is the tenant's own:

    h_0 = H(ROOT, block 0, "")  ...  h_k = H(h_{k-1}, block k, salt)  ...
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"pagedserve-prefix-root-v1"


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], salt: bytes | None = None) -> bytes:
    """Hash one full block given its parent's hash (None for block 0) and its salt, if it takes one.

    Block 0 always takes a salt (None counts as the empty salt).
    """
    hasher = hashlib.blake2b(digest_size=32)
    hasher.update(ROOT_HASH if parent_hash is None else parent_hash)
    hasher.update(len(token_ids).to_bytes(4, "little"))
    hasher.update(array("q", token_ids).tobytes())
    if parent_hash is None and salt is None:
        salt = b""
    if salt is not None:
        hasher.update(b"\x01" + len(salt).to_bytes(4, "little"))
        hasher.update(salt)
    return hasher.digest()


def extend_block_hashes(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    salt: bytes | None,
    num_shared_blocks: int = 0,
) -> None:
    """Append to `block_hashes` the hashes of the full blocks of `token_ids` not yet hashed.

    The salt enters at block `num_shared_blocks` (0 unless an operator-marked shared prefix
    covers the first blocks, which then take the empty salt).
    """
    num_full_blocks = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[i - 1] if i else None
        block_salt = (salt or b"") if i == num_shared_blocks else (b"" if i == 0 else None)
        block_hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], block_salt))
