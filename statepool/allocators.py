"""Free-list allocators for KV pages and Mamba state slots."""

from __future__ import annotations


class _FreeList:
    """Hands out integer ids 0..capacity-1; freeing an id that is not in use is an error."""

    kind = "id"

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"{self.kind} capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"out of {self.kind}s: asked for {count}, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(count)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"{self.kind} {i} freed but not in use")
            self._used.remove(i)
            self._free.append(i)


class PageAllocator(_FreeList):
    """KV cache pages."""

    kind = "KV page"


class SlotAllocator(_FreeList):
    """Mamba state slots (conv window + SSM state of every Mamba layer)."""

    kind = "state slot"
