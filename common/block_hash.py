"""Chained, deterministic hashes of token blocks: the identity of a cached prefix.

Block i's hash covers the parent block's hash and the block's token ids, so one hash names the whole
prefix up to the end of that block. blake2b over fixed-width little-endian ids is stable across processes,
machines and Python versions (unlike `hash()`), which the router's global prefix index relies on.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # DIGEST_SIZE bytes

DIGEST_SIZE = 16
ROOT_HASH: BlockHash = hashlib.blake2b(b"hybridserve/prefix-cache/v1", digest_size=DIGEST_SIZE).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one block given its parent's hash (ROOT_HASH for the first block)."""
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent + payload, digest_size=DIGEST_SIZE).digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, known: Sequence[BlockHash] = (), parent: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`; `known` is a correct prefix of the answer, reused as is."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes = list(known)
    if hashes:
        parent = hashes[-1]
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
