"""The pool's vocabulary: what it reads on a sequence, a prefix-cache hit, a planned checkpoint, and what an
early commit did (so a failed step can take it back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hybridserve.common.block_hash import BlockHash
from hybridserve.statepool.radix_cache import Node


class PooledSequence(Protocol):
    """What the pool reads and writes on a sequence (the engine's `Request`)."""

    page_ids: list[int]
    state_slot: int | None
    cache_nodes: list[Node]
    block_hashes: list[BlockHash]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> list[int]: ...


class StateSnapshot(Protocol):
    """Writes a sequence's state as it was after `num_tokens` tokens into checkpoint row `row`."""

    def __call__(self, seq: PooledSequence, num_tokens: int, row: int) -> None: ...


@dataclass(frozen=True)
class CacheHit:
    nodes: list[Node]  # root-first path to the deepest usable checkpoint
    num_tokens: int  # cached prefix length (a multiple of state_block, < the sequence's length)


NO_HIT = CacheHit([], 0)


@dataclass(frozen=True)
class EarlyCommit:
    """What `commit_prefills` did, so that a failed forward can take it back."""

    nodes_before: list[tuple[PooledSequence, int]]  # each prefilling sequence with its len(cache_nodes) before
    checkpoints: list[Node]  # nodes that received one of this step's checkpoints


@dataclass(frozen=True)
class PlannedCheckpoint:
    sequence: PooledSequence
    num_tokens: int  # boundary position
    slot: int  # checkpoint slot the forward writes, or -1 (not kept)
