"""Per-request state of the hybrid models: paged attention KV, Mamba conv/SSM slots, their allocators."""

from hybridserve.statepool.allocators import PageAllocator, SlotAllocator
from hybridserve.statepool.state_cache import CacheLayout, StateCache

__all__ = ["CacheLayout", "PageAllocator", "SlotAllocator", "StateCache"]
