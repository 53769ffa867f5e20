"""Per-request state of the hybrid models: paged attention KV, Mamba conv/SSM slots, checkpoint slots, the
radix prefix cache over them, cache events, and sizing from a memory budget."""

from hybridserve.statepool.allocators import CheckpointAllocator, PageAllocator, SlotAllocator
from hybridserve.statepool.block_hash import ROOT_HASH, BlockHash, block_hashes, hash_block
from hybridserve.statepool.events import CacheEvent, EventKind, EventLog
from hybridserve.statepool.pool import CacheHit, PoolIntegrityError, StatePool
from hybridserve.statepool.radix_cache import Node, RadixCache
from hybridserve.statepool.state_cache import CacheLayout, StateCache

__all__ = [
    "ROOT_HASH",
    "BlockHash",
    "CacheEvent",
    "CacheHit",
    "CacheLayout",
    "CheckpointAllocator",
    "EventKind",
    "EventLog",
    "Node",
    "PageAllocator",
    "PoolIntegrityError",
    "RadixCache",
    "SlotAllocator",
    "StateCache",
    "StatePool",
    "block_hashes",
    "hash_block",
]
