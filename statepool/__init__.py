"""Per-request state of the hybrid models: paged attention KV, Mamba conv/SSM slots, checkpoint slots, the
radix prefix cache over them, cache events, and sizing from a memory budget.

Names are imported on first use (PEP 562), so importing one module of this package does not load the rest
of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridserve.common.lazy_exports import lazy_getattr

_EXPORTS = {
    "CheckpointAllocator": "hybridserve.statepool.allocators",
    "PageAllocator": "hybridserve.statepool.allocators",
    "SlotAllocator": "hybridserve.statepool.allocators",
    "CacheEvent": "hybridserve.statepool.events",
    "EventKind": "hybridserve.statepool.events",
    "EventLog": "hybridserve.statepool.events",
    "CacheHit": "hybridserve.statepool.pool",
    "PoolIntegrityError": "hybridserve.statepool.pool",
    "StatePool": "hybridserve.statepool.pool",
    "Node": "hybridserve.statepool.radix_cache",
    "RadixCache": "hybridserve.statepool.radix_cache",
    "CacheLayout": "hybridserve.statepool.state_cache",
    "StateCache": "hybridserve.statepool.state_cache",
}
__all__ = [
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
]

if TYPE_CHECKING:
    from hybridserve.statepool.allocators import CheckpointAllocator, PageAllocator, SlotAllocator
    from hybridserve.statepool.events import CacheEvent, EventKind, EventLog
    from hybridserve.statepool.pool import CacheHit, PoolIntegrityError, StatePool
    from hybridserve.statepool.radix_cache import Node, RadixCache
    from hybridserve.statepool.state_cache import CacheLayout, StateCache

__getattr__ = lazy_getattr(__name__, _EXPORTS)
