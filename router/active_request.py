"""One in-flight request of the router: its live worker calls, so that an abort can cancel them."""

from __future__ import annotations

import asyncio
from typing import Any

from hybridserve.router.event_loop import task_cancelling


class ActiveRequest:
    """An in-flight request: its live calls, so that an abort can cancel them (on the loop)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.cancelled = asyncio.Event()
        self._calls: list[Any] = []
        self.session: Any = None  # the WorkerSession the current attempt went over (aborts go there), or None

    def track(self, call: Any) -> Any:
        self._calls.append(call)
        if self.cancelled.is_set():
            call.cancel()
        return call

    def cancel(self) -> None:
        self.cancelled.set()
        for call in self._calls:
            call.cancel()

    async def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, less when the request is aborted meanwhile."""
        try:
            await asyncio.wait_for(self.cancelled.wait(), seconds)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            pass


def aborted(active: ActiveRequest) -> bool:
    """Whether a CancelledError came from an abort of the request (its calls were cancelled) rather than from
    the task itself being cancelled (the client went away), which must propagate."""
    return active.cancelled.is_set() and not task_cancelling()
