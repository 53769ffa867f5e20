"""A bounded read-ahead of one worker token stream, so a client that stops reading cannot grow the router's
memory or hold a worker's slot forever.

A pump task reads the worker's events into a queue of at most `max_events`; when the queue stays full for
`stall_timeout_s` (the client is not reading), the worker call is cancelled, `on_stall` runs (the orchestrator
aborts the request on its workers) and the reader gets a RESOURCE_EXHAUSTED error instead of more events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from hybridserve.proto import common_pb2
from hybridserve.router.event_loop import task_cancelling

_END = object()


class StreamStalled(Exception):
    """The reader left the buffer full for longer than the stall timeout."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StreamBuffer:
    """Events of `call` (a grpc.aio stream call) read ahead into a bounded queue; `get()` in order, then None
    at the end of the stream; the call's error (an AioRpcError, or CancelledError when the call was
    cancelled) is raised by `get()` after the events before it."""

    def __init__(self, call: Any, max_events: int, stall_timeout_s: float, on_stall: Callable[[], None]) -> None:
        if max_events < 1 or stall_timeout_s <= 0:
            raise ValueError("a stream buffer needs max_events >= 1 and stall_timeout_s > 0")
        self._call = call
        self._queue: asyncio.Queue = asyncio.Queue(max_events)
        self._stall_timeout_s = stall_timeout_s
        self._on_stall = on_stall
        self._stalled: StreamStalled | None = None
        self._pump = asyncio.get_running_loop().create_task(self._run())

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
        self._pump.cancel()
