"""Free-list allocators for KV pages and Mamba state slots."""

from __future__ import annotations


class _FreeList:
    """Hands out integer ids first_id..first_id+capacity-1; freeing an id that is not in use is an error."""

    kind = "id"
    allow_empty = False

    def __init__(self, capacity: int, first_id: int = 0) -> None:
        if capacity < 0 or (capacity == 0 and not self.allow_empty):
            raise ValueError(f"{self.kind} capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.first_id = first_id
        self._free: list[int] = list(range(first_id + capacity - 1, first_id - 1, -1))
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
        ids = [self._free.pop() for _ in range(count)]  # lowest ids first
        self._used.update(ids)
        return ids

    def used_ids(self) -> set[int]:
        return set(self._used)

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


class CheckpointAllocator(_FreeList):
    """Checkpoint slots for cached Mamba states: rows of `conv_states` / `ssm_states` after the running slots
    (`capacity_own` of them, ids from `first_id`), and, with a `lender`, any running slot no sequence holds:
    a cached state lives in what running requests do not use, and `StatePool.admit` takes such a borrowed row
    back (evicting its checkpoint) when a request needs a slot. Zero rows and no lender turn checkpoints off."""

    kind = "checkpoint slot"
    allow_empty = True

    def __init__(self, capacity: int, first_id: int = 0, lender: SlotAllocator | None = None) -> None:
        super().__init__(capacity, first_id)
        self.capacity_own = capacity
        self.lender = lender
        self.capacity = capacity + (lender.capacity if lender is not None else 0)
        self._borrowed: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free) + (self.lender.num_free if self.lender is not None else 0)

    @property
    def num_borrowed(self) -> int:
        """Running-slot rows that hold a checkpoint now."""
        return len(self._borrowed)

    def is_borrowed(self, row: int) -> bool:
        return row in self._borrowed

    def borrowed_ids(self) -> set[int]:
        return set(self._borrowed)

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        """Own rows first; then idle running slots."""
        if count > self.num_free:
            raise RuntimeError(f"out of {self.kind}s: asked for {count}, {self.num_free} free")
        own = min(count, len(self._free))
        ids = super().allocate(own) if own else []
        if count > own:
            assert self.lender is not None
            lent = self.lender.allocate(count - own)
            self._borrowed.update(lent)
            self._used.update(lent)
            ids += lent
        return ids

    def free(self, ids: list[int]) -> None:
        lent = [i for i in ids if i in self._borrowed]
        own = [i for i in ids if i not in self._borrowed]
        for i in lent:
            self._borrowed.remove(i)
            self._used.remove(i)
        if lent:
            assert self.lender is not None
            self.lender.free(lent)
        if own:
            super().free(own)
