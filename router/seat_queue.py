"""A FIFO of requests waiting for a seat (state slot + pages) on one full decode worker.

Without it, every request that found its decode worker full re-sent Reserve after a random 20-100 ms: with a
burst of 100 such requests that is ~1,500 refused Reserves per second, each a trip to the worker's engine loop
between two decode steps, and the refusals' clean-up raced the next attempt. Here a refused request waits in line;
each request the router sees end on that worker wakes the head of the line, which then asks once. The head
also re-asks every `poll_s` (seats freed by other routers or expired reservations are seen that way), the rest of
the line only every `idle_poll_s`. One instance per decode worker, used on the router's event loop only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

MAX_CREDIT = 8  # bounds the immediate re-asks that stale credits can cause


class SeatQueue:
    """Waiters in arrival order; `seat_freed()` wakes the oldest one."""

    def __init__(self, poll_s: float = 0.25, idle_poll_s: float = 2.0) -> None:
        if poll_s <= 0 or idle_poll_s < poll_s:
            raise ValueError(f"poll_s must be > 0 and idle_poll_s >= poll_s, got {poll_s} and {idle_poll_s}")
        self.poll_s = poll_s  # the head of the line re-asks this often
        self.idle_poll_s = idle_poll_s  # the rest only this often (a wake-up that was lost), not every poll_s
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._credit = 0  # seats freed while nobody waited: the next waiters ask at once

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, again: bool = False, cancelled: asyncio.Event | None = None) -> bool:
        """Wait until a seat may be free (woken; at the head of the line, `poll_s` passed; elsewhere in it,
        `idle_poll_s` passed; or `cancelled` set); the caller then asks the worker again. True when it left from
        the head of the line (woken, or the head's poll): if the worker refuses it all the same, it passes
        `again=True` next time and keeps the head rather than queueing behind later requests."""
        if self._credit:
            self._credit -= 1
            return True
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        if again:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        watch: asyncio.Future[Any] | None = asyncio.ensure_future(cancelled.wait()) if cancelled is not None else None
        pending: list[asyncio.Future[Any]] = [waiter] if watch is None else [waiter, watch]
        give_up = loop.time() + self.idle_poll_s
        try:
            while True:
                done, _ = await asyncio.wait(pending, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
                at_head = bool(self._waiters) and self._waiters[0] is waiter
                if done or at_head or loop.time() >= give_up:
                    return (waiter.done() and not waiter.cancelled()) or (at_head and not (watch and watch.done()))
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
