"""A bounded read-ahead of one worker token stream, so a client that stops reading cannot grow the router's
memory or hold a worker's slot forever.

While the reader keeps up (it is back for the next event within READ_AHEAD_AFTER_S of the last), `get()`
reads the worker's call itself: no task, no queue, one wake-up per event. Once the reader stays away longer
(its client is slow or gone), a pump task takes over the reading into a queue of at most `max_events`; when
that queue stays full for `stall_timeout_s` (the client is not reading), the worker call is cancelled,
`on_stall` runs (the orchestrator aborts the request on its workers) and the reader gets a RESOURCE_EXHAUSTED
error instead of more events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from hybridserve.proto import common_pb2
from hybridserve.router.event_loop import task_cancelling

_END = object()
READ_AHEAD_AFTER_S = 0.05  # a reader away this long (slow or gone client) gets a pump task reading ahead


class StreamStalled(Exception):
    """The reader left the buffer full for longer than the stall timeout."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StreamBuffer:
    """Events of `call` (a grpc.aio stream call) in order from `get()`, then None at the end of the stream; the
    call's error (an AioRpcError, or CancelledError when the call was cancelled) is raised by `get()` after the
    events before it. Read directly while the reader keeps up, read ahead (bounded) once it does not."""

    def __init__(self, call: Any, max_events: int, stall_timeout_s: float, on_stall: Callable[[], None],
                 read_ahead_after_s: float = READ_AHEAD_AFTER_S) -> None:
        if max_events < 1 or stall_timeout_s <= 0 or read_ahead_after_s <= 0:
            raise ValueError("a stream buffer needs max_events >= 1, stall_timeout_s > 0 and read_ahead_after_s > 0")
        self._call = call
        self._max_events = max_events
        self._stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall
        self._after_s = read_ahead_after_s
        self._stalled: StreamStalled | None = None
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue | None = None
        self._pump: asyncio.Task | None = None
        # when the reader last left with an event (it is made as the first event goes out); None: inside get()
        self._away_since: float | None = self._loop.time()
        self._watch: asyncio.TimerHandle | None = self._loop.call_later(read_ahead_after_s, self._check)

    @property
    def reading_ahead(self) -> bool:
        """Whether the pump task has taken over (the reader fell behind once)."""
        return self._pump is not None

    def _check(self) -> None:
        """Timer: start reading ahead when the reader has been away for `read_ahead_after_s`, else look again
        later (one timer per stream, not one per event)."""
        away = self._away_since
        if away is not None and self._loop.time() - away >= self._after_s:
            self._watch = None
            self._queue = asyncio.Queue(self._max_events)
            self._pump = self._loop.create_task(self._run())
        else:
            self._watch = self._loop.call_later(self._after_s, self._check)

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    async def _run(self) -> None:
        item: Any
        while True:
            try:
                event = await self._call.read()
            except asyncio.CancelledError:
                if task_cancelling():
                    raise  # close(): nobody reads any more
                item = asyncio.CancelledError()  # the call itself was cancelled (an abort)
            except grpc.RpcError as exc:
                item = exc
            else:
                item = _END if event is grpc.aio.EOF else event
            if not await self._put(item):
                return
            if not isinstance(item, common_pb2.TokenEvent) or item.finish_reason:
                return

    async def _put(self, item: Any) -> bool:
        """Queue `item`, waiting up to the stall timeout for room; False (and the stall handled) if none came."""
        assert self._queue is not None  # the pump runs only with its queue
        try:
            self._queue.put_nowait(item)
            return True
        except asyncio.QueueFull:
            pass
        try:
            await asyncio.wait_for(self._queue.put(item), self._stall_timeout_s)
            return True
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            self._stalled = StreamStalled(f"the client did not read its stream for {self._stall_timeout_s:g} s "
                                          f"with {self._queue.maxsize} events waiting; the request was aborted")
            self._call.cancel()
            self._on_stall()
            return False

    async def get(self) -> common_pb2.TokenEvent | None:
        if self._stalled is not None:
            raise self._stalled
        if self._queue is None:  # the reader keeps up: read the call here
            self._away_since = None
            try:
                event = await self._call.read()
            except BaseException:
                self._stop_watch()
                raise
            if event is grpc.aio.EOF:
                self._stop_watch()
                return None
            if event.finish_reason:
                self._stop_watch()  # nothing more to read
            else:
                self._away_since = self._loop.time()
            return event
        item = await self._queue.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    @property
    def stalled(self) -> bool:
        return self._stalled is not None

    def close(self) -> None:
        self._stop_watch()
        if self._pump is not None:
            self._pump.cancel()
