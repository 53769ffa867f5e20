"""The router's end of a socket session (`worker_runtime/session_socket.py`), shaped like the grpc.aio stream call
`WorkerSession` drives: `write()`, `read()` (SessionEvents, then `grpc.aio.EOF`), `cancel()`, `done()`.

An asyncio protocol on the router's loop: the worker's frames are parsed in `data_received` and queued for the
session's reader task, and a write is one `transport.write`; no thread hand-off on either side, which is what
the gRPC session costs per message. Failures surface as `SessionError`s with the status a gRPC session would
have ended with (UNAVAILABLE: not reachable or gone; UNAUTHENTICATED: the worker refused the token).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import grpc

from hybridserve.proto import worker_pb2
from hybridserve.proto.session_frames import VERSION, FrameError, FrameSplitter, encode, keep_alive, parse
from hybridserve.router.worker_session import CODES, SessionError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # to connect and get the worker's hello reply


class SocketSessionCall:
    """One socket session to `host:port`. It connects at once; writes wait for the worker's hello reply. If
    the worker cannot be reached or refuses the hello, `on_unreachable` runs (the handle opens its later
    sessions over gRPC) and, given a `fallback`, this call becomes the call `fallback()` opens: the requests
    already written to it go there, none fails for it. An established session that breaks does not fall back
    (its requests fail with UNAVAILABLE, as a broken gRPC session's)."""

    def __init__(self, host: str, port: int, token: str | None, fallback: Callable[[], Any] | None = None,
                 on_unreachable: Callable[[SessionError], None] | None = None, worker_id: str = "") -> None:
        self.address = f"{host}:{port}"
        self._worker_id = worker_id  # the worker meant (its Health's); a hello reply naming another is refused
        self._loop = loop = asyncio.get_running_loop()
        self._token = token or ""
        self._fallback = fallback
        self._on_unreachable = on_unreachable
        self._delegate: Any = None  # the fallback's call, once this one fell back
        self._transport: asyncio.Transport | None = None
        self._splitter = FrameSplitter()
        self._greeted = False  # the worker's hello reply arrived and accepted us
        self._handshake: asyncio.Future[None] = loop.create_future()  # the hello reply's outcome
        self._ready: asyncio.Future[None] = loop.create_future()  # writes may go (here or to the fallback)
        self._items: collections.deque[Any] = collections.deque()  # SessionEvents, then EOF or a SessionError
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None  # set while the transport's buffer is over its mark
        self._ended = False
        self._cancelled = False
        self._connect_task = loop.create_task(self._connect(host, port))

    # ---- the call's interface --------------------------------------------------------------------------
    async def write(self, request: worker_pb2.SessionRequest) -> None:
        if not self._ready.done():
            await asyncio.shield(self._ready)
        if self._delegate is not None:
            return await self._delegate.write(request)
        self._ready.result()  # raises the connect / hello failure
        if self._ended or self._transport is None:
            raise SessionError(grpc.StatusCode.UNAVAILABLE, f"the socket session to {self.address} is closed")
        self._transport.write(encode(request))
        if self._writable is not None:  # the worker is not reading: wait like grpc.aio's write would
            await asyncio.shield(self._writable)

    async def read(self) -> worker_pb2.SessionEvents | Any:
        while not self._items or self._cancelled:
            if self._cancelled:  # as a cancelled grpc.aio call's read
                raise asyncio.CancelledError()
            if self._delegate is not None:
                return await self._delegate.read()
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        if self._delegate is not None:
            self._cancelled = True
            return bool(self._delegate.cancel())
        if self._ended:
            return False
        self._cancelled = True
        self._end(SessionError(grpc.StatusCode.CANCELLED, "the session was cancelled"))
        return True

    def done(self) -> bool:
        return bool(self._delegate.done()) if self._delegate is not None else self._ended

    # ---- the connection --------------------------------------------------------------------------------
    async def _connect(self, host: str, port: int) -> None:
        try:
            await asyncio.wait_for(self._open(host, port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:  # TimeoutError's alias from 3.11; its own class on 3.10
            self._unreachable(SessionError(grpc.StatusCode.UNAVAILABLE,
                                           f"could not open a socket session to {self.address}: {exc or 'timed out'}"))
        except SessionError as exc:
            self._unreachable(exc)
        except asyncio.CancelledError:
            return
        except Exception as exc:  # never leave writers waiting on _ready
            logger.exception("socket session to %s: opening failed", self.address)
            self._end(SessionError(grpc.StatusCode.UNAVAILABLE, f"opening the socket session to {self.address} "
                                                                f"failed: {exc!r}"))
        else:
            if not self._ready.done():
                self._ready.set_result(None)

    async def _open(self, host: str, port: int) -> None:
        await self._loop.create_connection(lambda: _Protocol(self), host, port)
        await asyncio.shield(self._handshake)

    def _unreachable(self, error: SessionError) -> None:
        if self._cancelled or self._ended:
            return
        if self._on_unreachable is not None:
            self._on_unreachable(error)
        if self._fallback is None:
            self._end(error)
            return
        self._drop_transport()
        self._delegate = self._fallback()
        self._ready.set_result(None)  # writers go to the delegate
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)  # so does the reader

    def _connected(self, transport: asyncio.Transport) -> None:
        if self._ended:
            transport.abort()
            return
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            keep_alive(sock)
        transport.write(encode(worker_pb2.SessionHello(token=self._token, version=VERSION)))

    def _data(self, data: bytes) -> None:
        try:
            payloads = self._splitter.feed(data)
            for payload in payloads:
                if self._greeted:
                    self._push(parse(worker_pb2.SessionEvents, payload))
                else:
                    self._hello_reply(parse(worker_pb2.SessionHelloReply, payload))
        except FrameError as exc:
            logger.warning("socket session to %s: %s", self.address, exc)
            if not self._greeted:  # not a worker's session port (another service, a wrong mapping): fall back
                if not self._handshake.done():
                    self._handshake.set_exception(SessionError(
                        grpc.StatusCode.UNAVAILABLE, f"{self.address} does not answer as a socket session: {exc}"))
                return
            # a broken stream, as a broken gRPC session: UNAVAILABLE (retried before a request's first token)
            self._end(SessionError(grpc.StatusCode.UNAVAILABLE, f"the socket session to {self.address} broke: {exc}"))

    def _hello_reply(self, reply: worker_pb2.SessionHelloReply) -> None:
        code = CODES.get(reply.code, grpc.StatusCode.UNKNOWN)
        if code is not grpc.StatusCode.OK:
            error = SessionError(code, f"the decode worker at {self.address} refused the socket session: "
                                       f"{reply.message}")
            if not self._handshake.done():
                self._handshake.set_exception(error)
            return
        if self._worker_id and reply.worker_id and reply.worker_id != self._worker_id:
            # a remapped port or a reused address: another worker (maybe sharing the token) answered
            if not self._handshake.done():
                self._handshake.set_exception(SessionError(
                    grpc.StatusCode.UNAVAILABLE, f"the socket session at {self.address} is worker "
                                                 f"{reply.worker_id!r}, not {self._worker_id!r}"))
            return
        self._greeted = True
        if not self._handshake.done():
            self._handshake.set_result(None)

    def _lost(self, exc: Exception | None) -> None:
        if self._greeted:
            self._end(SessionError(grpc.StatusCode.UNAVAILABLE,
                                   f"the socket session to {self.address} ended{f': {exc}' if exc else ''}"))
        elif not self._handshake.done():
            self._handshake.set_exception(SessionError(grpc.StatusCode.UNAVAILABLE,
                                                       f"{self.address} closed the connection before its hello reply"))

    def _push(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _end(self, last: SessionError) -> None:
        """The session is over: reads drain what arrived, then get EOF (a clean end) or `last`."""
        if self._ended:
            return
        self._ended = True
        for future in (self._handshake, self._ready):
            if not future.done():
                future.set_exception(last)
                future.exception()  # retrieved: no "never retrieved" warning when nothing waits on it
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._drop_transport()
        if not self._connect_task.done():
            self._connect_task.cancel()
        self._push(last)

    def _drop_transport(self) -> None:
        """Abort the connection (if any); what it still delivers is ignored."""
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.abort()

    def _pause(self, paused: bool) -> None:
        if paused and self._writable is None:
            self._writable = self._loop.create_future()
        elif not paused and self._writable is not None:
            if not self._writable.done():
                self._writable.set_result(None)
            self._writable = None


class _Protocol(asyncio.Protocol):
    """Hands the transport's events to its call."""

    def __init__(self, call: SocketSessionCall) -> None:
        self._call = call

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._call._connected(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self._call._data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._call._lost(exc)

    def pause_writing(self) -> None:
        self._call._pause(True)

    def resume_writing(self) -> None:
        self._call._pause(False)
