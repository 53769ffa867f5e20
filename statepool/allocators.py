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
    """Checkpoint slots for cached Mamba states; they live after the running slots in the same tensors,
    so a checkpoint id is a row of `conv_states` / `ssm_states`. Zero capacity turns checkpoints off."""

    kind = "checkpoint slot"
    allow_empty = True
