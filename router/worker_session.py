"""The router's side of a decode worker session: requests multiplexed over one long-lived stream (local ones,
and the token streams of requests prefilled elsewhere): the worker's socket session where it offers one
(router/session_socket.py), otherwise its gRPC `Session` stream.

Each request is one `SessionRequest` written on the stream and a `SessionStream` the orchestrator reads like a
grpc.aio call (`read()` gives TokenEvents, then `grpc.aio.EOF`; a failure raises a `grpc.RpcError` with its
status; `cancel()` makes reads raise `asyncio.CancelledError`). One reader task hands the worker's batches of
events to the streams they name. The session opens on first use; when it breaks, every request on it fails
with UNAVAILABLE (retried elsewhere before its first token, as a failed call would be) and the next request
opens a new one. Only workers whose Health says `sessions` get one; the requests of others (older versions)
go over GenerateLocal calls, as before sessions.

All of it runs on the router's event loop (`router/event_loop.py`): no locks, except the one that keeps two
writes from overlapping on the stream, which grpc.aio does not allow.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import grpc

from hybridserve.proto import common_pb2, worker_pb2
from hybridserve.router.stream_buffer import StreamStalled

logger = logging.getLogger(__name__)


class SessionError(grpc.RpcError):
    """A request's failure on a session, with the status a GenerateLocal call would have ended with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


CODES = {code.value[0]: code for code in grpc.StatusCode}
_CANCELLED = object()


class SessionStream:
    """One request's events on a session, read like a grpc.aio stream call. It is its own bounded read-ahead
    too (`watch()`, then `get()` as `StreamBuffer`'s): the session's reader already queues the events here, and
    a pump task per request on top would cost a task switch per event."""

    __slots__ = ("request_id", "_session", "_loop", "_items", "_waiter", "_timer", "done", "_max_events", "_stall_s",
                 "_on_stall", "_stall_timer", "_stalled")

    def __init__(self, session: WorkerSession, request_id: str, timeout_s: float) -> None:
        self.request_id = request_id
        self._session = session
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.done = False  # finished, failed or cancelled: the session no longer routes events to it
        # the loop, looked up once: asyncio.get_running_loop() per event is a thread-state lookup (and on Python
        # 3.11 a getpid() system call) each time
        self._loop = loop = asyncio.get_running_loop()
        self._timer = loop.call_later(timeout_s, self._expire, timeout_s)
        self._max_events = 0  # 0: unbounded (not watched)
        self._stall_s = 0.0
        self._on_stall: Callable[[], None] | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stalled: StreamStalled | None = None

    async def read(self) -> common_pb2.TokenEvent | Any:
        """The next event, or grpc.aio.EOF after the finished one; raises the request's failure."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items[0]
        if item is _CANCELLED:
            raise asyncio.CancelledError()
        if isinstance(item, BaseException):
            raise item
        self._items.popleft()
        if self._stall_timer is not None and len(self._items) <= self._max_events:
            self._stall_timer.cancel()  # the reader caught up
            self._stall_timer = None
        return item

    # ---- the bounded read-ahead (StreamBuffer's interface) -----------------------------------------------
    def watch(self, max_events: int, stall_timeout_s: float, on_stall: Callable[[], None]) -> SessionStream:
        """Bound the events waiting here: more than `max_events` for `stall_timeout_s` (the client is not
        reading) stops the stream, runs `on_stall` (the orchestrator aborts the request) and makes `get()`
        raise StreamStalled."""
        if max_events < 1 or stall_timeout_s <= 0:
            raise ValueError("a stream buffer needs max_events >= 1 and stall_timeout_s > 0")
        self._max_events, self._stall_s, self._on_stall = max_events, stall_timeout_s, on_stall
        return self

    async def get(self) -> common_pb2.TokenEvent | None:
        """The next event, None at the end; raises StreamStalled, the request's failure or CancelledError."""
        if self._stalled is not None:
            raise self._stalled
        item = await self.read()
        return None if item is grpc.aio.EOF else item

    @property
    def stalled(self) -> bool:
        return self._stalled is not None

    def close(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stall(self) -> None:
        self._stall_timer = None
        self._stalled = StreamStalled(f"the client did not read its stream for {self._stall_s:g} s with more "
                                      f"than {self._max_events} events waiting; the request was aborted")
        self._end(_CANCELLED)
        if self._on_stall is not None:
            self._on_stall()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def cancel(self) -> bool:
        """Stop delivering: reads raise CancelledError (the orchestrator aborts the request on the worker)."""
        if self.done and self._items and self._items[-1] is grpc.aio.EOF:
            return False  # finished already
        self._end(_CANCELLED)
        return True

    # ---- the session's side ----------------------------------------------------------------------------
    def _push(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        elif self._max_events and not self.done and self._stall_timer is None and len(self._items) > self._max_events:
            self._stall_timer = self._loop.call_later(self._stall_s, self._stall)

    def _event(self, event: common_pb2.TokenEvent) -> None:
        self._push(event)
        if event.finish_reason:
            self._end(grpc.aio.EOF)

    def _end(self, last: Any) -> None:
        """Push the stream's last item (EOF, an error, the cancel marker) and detach it from the session."""
        if self.done:
            return
        self.done = True
        self._timer.cancel()
        if last is not grpc.aio.EOF:
            self.close()  # nothing more arrives: no stall to watch for
        self._session._detach(self.request_id, self)
        self._push(last)

    def _expire(self, timeout_s: float) -> None:
        self._end(SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request ran past its {timeout_s:g} s deadline"))


class WorkerSession:
    """One decode worker's session, made on the router's loop; `open()` starts a request on it."""

    def __init__(self, address: str, open_call: Callable[[], Any]) -> None:
        self.address = address
        # opens the session's stream: a grpc.aio DecodeWorker.Session call or a socket session
        # (router/session_socket.py), which has the same write / read / cancel / done
        self._open_call = open_call
        self._call: Any = None
        self._reader: asyncio.Task | None = None
        self._streams: dict[str, SessionStream] = {}
        self._write_lock = asyncio.Lock()
        self._idle = asyncio.Event()  # set whenever the last open request detaches

    async def open(self, request: worker_pb2.SessionRequest, timeout_s: float) -> SessionStream:
        """Send a generate or stream_tokens request on the session (opening it if needed); failures come out of
        the stream's reads."""
        rid = request.generate.request_id if request.HasField("generate") else request.stream_tokens.request_id
        if rid in self._streams:  # the orchestrator refuses duplicate ids before this; kept as a guard
            stream = SessionStream(self, rid, timeout_s)
            stream._end(SessionError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already on this session"))
            return stream
        call = self._ensure_call()
        stream = self._streams[rid] = SessionStream(self, rid, timeout_s)
        if not await self._write(call, request) and self._call is not call:
            # the call ended and its reader is through (it ended the streams it knew, this one included unless
            # it came later); while the reader still runs, it ends this stream with the call's own outcome
            stream._end(SessionError(grpc.StatusCode.UNAVAILABLE, f"the session to {self.address} is closed"))
        return stream

    async def abort(self, request_id: str) -> bool:
        """Abort a request sent on this session (ordered after its generate); False if the session is gone
        (the worker aborts the requests of a session that ends)."""
        call = self._call
        if call is None:
            return False
        return await self._write(call, worker_pb2.SessionRequest(abort=common_pb2.AbortRequest(request_id=request_id)))

    async def close(self) -> None:
        """Cancel the session; its open requests fail with UNAVAILABLE."""
        call, reader = self._call, self._reader
        if call is not None:
            call.cancel()
        if reader is not None:
            await asyncio.gather(reader, return_exceptions=True)

    async def close_when_idle(self, timeout_s: float) -> None:
        """Close once every open request is done, or after `timeout_s` (then those still open fail with
        UNAVAILABLE): a retired worker's in-flight requests finish on it, and its stream does not outlive them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._streams and loop.time() < deadline:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), deadline - loop.time())
            except asyncio.TimeoutError:  # TimeoutError's alias from 3.11; a class of its own on 3.10
                break
        await self.close()

    # ---- internals -------------------------------------------------------------------------------------
    def _ensure_call(self) -> Any:
        if self._call is None:
            self._call = self._open_call()
            self._reader = asyncio.get_running_loop().create_task(self._read(self._call))
        return self._call

    async def _write(self, call: Any, message: worker_pb2.SessionRequest) -> bool:
        async with self._write_lock:
            if call is not self._call or call.done():
                return False
            try:
                await call.write(message)
            except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                logger.debug("session to %s: write failed: %r", self.address, exc)
                return False
        return True

    async def _read(self, call: Any) -> None:
        failure = SessionError(grpc.StatusCode.UNAVAILABLE, f"the session to {self.address} ended")
        try:
            while True:
                batch = await call.read()
                if batch is grpc.aio.EOF:
                    break
                for refused in batch.refused:
                    stream = self._streams.get(refused.request_id)
                    if stream is not None:
                        code = CODES.get(refused.code, grpc.StatusCode.UNKNOWN)
                        stream._end(SessionError(code, refused.message))
                for event in batch.events:
                    stream = self._streams.get(event.request_id)
                    if stream is not None:
                        stream._event(event)
        except asyncio.CancelledError:
            pass  # close(): the call was cancelled
        except grpc.RpcError as exc:
            failure = SessionError(exc.code() if exc.code() != grpc.StatusCode.CANCELLED else grpc.StatusCode.UNAVAILABLE,
                                   f"the session to {self.address} failed: {exc.details()}")
            logger.warning("session to decode worker %s ended: %s %s", self.address, exc.code(), exc.details())
        finally:
            if self._call is call:
                self._call, self._reader = None, None
            for stream in list(self._streams.values()):
                stream._end(failure)

    def _detach(self, request_id: str, stream: SessionStream) -> None:
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]
            if not self._streams:
                self._idle.set()
