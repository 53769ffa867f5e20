"""One registered buffer per worker that states are staged in (prefill) or land in (decode).

Device data planes need memory registered up front (a CUDA IPC handle, a NIXL registration): registering
per transfer costs milliseconds. So each worker owns one flat uint8 tensor, registered once, and hands out
byte ranges of it. A range is freed once its transfer ended; on the GPU, with an event the next user of the
range waits for, so queued copies out of it finish first.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

ALIGN = 256  # bytes: every range starts aligned for any dtype view and for DMA engines


class ArenaFull(RuntimeError):
    """No range of the asked size came free in time (the caller falls back or retries)."""


@dataclass
class ArenaRange:
    """`nbytes` bytes at `offset` of the arena's buffer; `data` views them."""

    offset: int
    nbytes: int
    data: torch.Tensor = field(repr=False)  # [nbytes] uint8


class Arena:
    """First-fit byte-range allocator over one uint8 tensor; thread-safe; `allocate` waits for room."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu", pin_memory: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes} bytes")
        self.device = torch.device(device)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device,
                                  pin_memory=pin_memory and self.device.type == "cpu")  # [nbytes]
        self.capacity = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, size) holes
        self._fences: list[tuple[int, int, torch.cuda.Event]] = []  # (start, end, event of the last reader)
        self._cond = threading.Condition()

    def fits(self, nbytes: int) -> bool:
        """Whether a range of nbytes can ever be allocated here."""
        return 0 < _aligned(nbytes) <= self.capacity

    def allocate(self, nbytes: int, timeout: float = 0.0) -> ArenaRange:
        """A range of nbytes (waits up to `timeout` s for one to come free); raises ArenaFull."""
        if not self.fits(nbytes):
            raise ArenaFull(f"{nbytes} bytes never fit this {self.capacity}-byte arena")
        size = _aligned(nbytes)
        deadline = time.monotonic() + timeout
        with self._cond:
            while (offset := self._take(size)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ArenaFull(f"no free {size}-byte range in the {self.capacity}-byte arena")
                self._cond.wait(left)
            self._fences = [f for f in self._fences if not f[2].query()]  # drop the finished ones
            fences = [event for start, end, event in self._fences if start < offset + size and offset < end]
        if fences and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for event in fences:
                stream.wait_event(event)  # copies queued out of these bytes by their last user finish first
        return ArenaRange(offset, nbytes, self.buffer[offset : offset + nbytes])

    def free(self, block: ArenaRange, after: torch.cuda.Event | None = None) -> None:
        """Return a range; `after`: an event recorded behind the last queued work that reads it."""
        size = _aligned(block.nbytes)
        with self._cond:
            if after is not None:
                self._fences.append((block.offset, block.offset + size, after))
            self._free.append((block.offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for offset, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == offset:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((offset, length))
            self._free = merged
            self._cond.notify_all()

    def free_bytes(self) -> int:
        with self._cond:
            return sum(size for _, size in self._free)

    def _take(self, size: int) -> int | None:
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    self._free.pop(i)
                else:
                    self._free[i] = (offset + size, length - size)
                return offset
        return None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
