"""Awaiting work for an HTTP client that may leave: admission's wait in line and the answer itself are
cancelled once the client has disconnected, so a client that gives up frees its place and aborts its work."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")

DISCONNECT_POLL_S = 0.05


class ClientGone(Exception):
    """The client disconnected before its answer was ready; the work was cancelled."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` in this task; once it has run DISCONNECT_POLL_S, a watcher polls the connection every
    DISCONNECT_POLL_S and cancels the work when the client has left (raising ClientGone). A request answered
    sooner (the usual case) costs one timer, not a task of its own plus an asyncio.wait per poll."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    gone = False
    watcher: asyncio.Task | None = None

    async def watch() -> None:
        nonlocal gone
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        gone = True
        if task is not None:
            task.cancel()

    def start_watching() -> None:
        nonlocal watcher
        watcher = loop.create_task(watch())

    timer = loop.call_later(DISCONNECT_POLL_S, start_watching)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (server shutdown): not ours to swallow
        uncancel = getattr(task, "uncancel", None)  # Python >= 3.11: this task is no longer being cancelled
        if uncancel is not None:
            uncancel()
        raise ClientGone() from None
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()
