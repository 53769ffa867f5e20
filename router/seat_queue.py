"""A FIFO of requests waiting for a seat (state slot + pages) on one full decode worker.

Without it, every request that found its decode worker full re-sent Reserve after a random 20-100 ms: with a
burst of 100 such requests that is ~1,500 refused Reserves per second, each a trip to the worker's engine loop
between two decode steps, and the refusals' clean-up raced the next attempt. Here a refused request waits in line;
each request the router sees end on that worker wakes the head of the line, which then asks once. A wait also
ends after `poll_s` (seats freed by other routers or expired reservations are seen that way). One instance per
decode worker, used on the router's event loop only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

MAX_CREDIT = 8  # bounds the immediate re-asks that stale credits can cause


class SeatQueue:
    """Waiters in arrival order; `seat_freed()` wakes the oldest one."""

    def __init__(self, poll_s: float = 0.25) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.poll_s = poll_s
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._credit = 0  # seats freed while nobody waited: the next waiters ask at once

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, again: bool = False, cancelled: asyncio.Event | None = None) -> bool:
        """Wait until a seat may be free (woken, `poll_s` passed, or `cancelled` set); the caller then asks the
        worker again. True when a freed seat woke it. `again`: the caller was woken for a seat and refused all
        the same (a newcomer took it first), so it goes back to the head of the line."""
        if self._credit:
            self._credit -= 1
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if again:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        watch: asyncio.Future[Any] | None = asyncio.ensure_future(cancelled.wait()) if cancelled is not None else None
        pending: list[asyncio.Future[Any]] = [waiter] if watch is None else [waiter, watch]
        try:
            await asyncio.wait(pending, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
            return waiter.done() and not waiter.cancelled()
        finally:
            if watch is not None:
                watch.cancel()
            if not waiter.done():
                waiter.cancel()
            try:
                self._waiters.remove(waiter)
            except ValueError:  # already popped by seat_freed
                pass

    def seat_freed(self) -> None:
        """A request on the worker ended: wake the oldest waiter still waiting."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._credit = min(self._credit + 1, MAX_CREDIT)
