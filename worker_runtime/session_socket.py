"""A decode worker's socket sessions: the `DecodeWorker.Session` protocol on a plain TCP stream.

A router relaying a short request over the gRPC session pays ~1 ms in Python gRPC's machinery (every message
crosses grpc's EventEngine thread, its completion-queue poller and the event loop: bench/results/cpu/router/);
here a message is one `sendall` on one side and one `data_received` on the other. Frames and the hello are in
`proto/session_frames.py`. Each connection is one session, served on a thread of its own by the same handler
as the gRPC method (`handler(requests, context)` yields SessionEvents): one implementation of the session's
rules, two transports.

The router's hello carries the internal token (checked in constant time, as the gRPC interceptor does). With
internal TLS on, workers offer no socket sessions (the router keeps the gRPC session): an OpenSSL connection
cannot be read and written from two threads at once, which this thread-per-direction design needs.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from hybridserve.proto import worker_pb2
from hybridserve.proto.channels import is_loopback
from hybridserve.proto.session_frames import (
    MAX_HELLO_BYTES,
    VERSION,
    FrameError,
    encode,
    keep_alive,
    parse,
    recv_frame,
)

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # a connection that sends no hello in this long is closed
LINGER_S = 0.1  # a stopping server's connections: between ending the sends and closing
MAX_CONNECTIONS = 256  # connections at once (one per router is the norm); more are closed at once
Handler = Callable[[Iterator[worker_pb2.SessionRequest], Any], Iterator[worker_pb2.SessionEvents]]


class SocketSessionContext:
    """The part of `grpc.ServicerContext` a session handler uses: liveness and end-of-session callbacks."""

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self._lock = threading.Lock()
        self._active = True
        self._callbacks: list[Callable[[], None]] = []

    def peer(self) -> str:
        return self._peer

    def is_active(self) -> bool:
        return self._active

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._active:
                self._callbacks.append(callback)
                return True
        return False

    def end(self) -> None:
        """The connection is gone: run the callbacks once (as grpc does when an RPC terminates)."""
        with self._lock:
            if not self._active:
                return
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("socket session %s: an end-of-session callback failed", self._peer)


class SessionSocketServer:
    """Listens on `host:port` (0: a free port) and serves each connection as one session with `handler`."""

    def __init__(self, host: str, port: int, handler: Handler, token: str | None, name: str = "session-socket",
                 worker_id: str = "") -> None:
        self._host, self._port = host, port
        self._worker_id = worker_id  # named in every hello reply
        self._handler = handler
        self._token = (token or "").encode()
        self._name = name
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, tuple[threading.Thread, SocketSessionContext]] = {}
        self._closed = False
        self._stopping = threading.Event()  # stop(): sessions flush what they hold and end

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> int:
        """Bind and start accepting; returns the bound port."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self._host, self._port))
        except OSError as exc:
            listener.close()
            raise RuntimeError(f"could not bind the socket session server to {self._host}:{self._port}: {exc}") from exc
        listener.listen(128)
        self._listener = listener
        self._port = listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(listener,), name=f"{self._name}-accept", daemon=True).start()
        if not self._token and not is_loopback(self._host):  # the gRPC server said so too; this port is another door
            logger.info("socket sessions on %s:%d take no internal token", self._host, self._port)
        return self._port

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop accepting; each session sends what its requests output so far (a drained worker's last events
        are still on their way) and ends, up to `grace_s` in all; then the rest are closed (their open
        requests are aborted)."""
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
            connections = dict(self._connections)
        self._stopping.set()
        if listener is not None:
            _close(listener)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RD)  # the reader sees the end of requests, as after a half-close
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for thread, _ in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        for conn, (_, context) in connections.items():
            context.end()  # past the grace: what a session still runs is aborted now, not when a send fails
            _close(conn)

    # ---- internals -------------------------------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except OSError as exc:
                if self._closed:
                    return  # stop() closed the listener
                logger.warning("socket sessions: accept failed (%s); retrying", exc)  # out of files, say
                time.sleep(0.1)
                continue
            with self._lock:
                if self._closed:
                    _close(conn)
                    return
                if len(self._connections) >= MAX_CONNECTIONS:  # no thread for it: the router falls back to gRPC
                    logger.warning("socket sessions: %d open, refusing %s", MAX_CONNECTIONS, peer)
                    _close(conn)
                    continue
                context = SocketSessionContext(f"{peer[0]}:{peer[1]}")
                thread = threading.Thread(target=self._serve, args=(conn, context), name=f"{self._name}-conn",
                                          daemon=True)
                try:
                    thread.start()  # under the lock: stop() never sees a thread it cannot join
                except RuntimeError as exc:
                    logger.warning("socket sessions: no thread for %s (%s)", peer, exc)
                    _close(conn)
                    continue
                self._connections[conn] = (thread, context)

    def _serve(self, conn: socket.socket, context: SocketSessionContext) -> None:
        peer = context.peer()
        try:
            keep_alive(conn)
            if not self._hello(conn, peer):
                return
            conn.settimeout(None)
            for message in self._handler(self._requests(conn, context), context):
                conn.sendall(encode(message))
        except (OSError, FrameError) as exc:
            logger.info("socket session %s ended: %s", peer, exc)
        except Exception:
            logger.exception("socket session %s failed", peer)
        finally:
            context.end()
            with self._lock:
                self._connections.pop(conn, None)
            _close(conn, linger=self._stopping.is_set())

    def _hello(self, conn: socket.socket, peer: str) -> bool:
        """Read and check the router's hello, answer it; False (answered and logged) if refused."""
        try:  # one deadline for the whole hello: a byte every few seconds does not hold a connection
            payload = recv_frame(conn, MAX_HELLO_BYTES, time.monotonic() + HELLO_TIMEOUT_S)
        except TimeoutError:
            logger.warning("socket session %s: no hello within %g s; closed", peer, HELLO_TIMEOUT_S)
            return False
        if payload is None:
            return False
        hello = parse(worker_pb2.SessionHello, payload)
        code, message = grpc.StatusCode.OK, ""
        if hello.version != VERSION:
            code, message = grpc.StatusCode.FAILED_PRECONDITION, (
                f"socket session version {hello.version} is not served here (this worker speaks {VERSION})")
        elif not hmac.compare_digest(hello.token.encode(), self._token):
            code, message = grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token"
        conn.sendall(encode(worker_pb2.SessionHelloReply(code=code.value[0], message=message,
                                                         worker_id=self._worker_id)))
        if code is not grpc.StatusCode.OK:
            logger.warning("socket session %s refused: %s", peer, message)
            return False
        return True

    def _requests(self, conn: socket.socket, context: SocketSessionContext) -> Iterator[worker_pb2.SessionRequest]:
        """The router's SessionRequests until it closes the connection; then the session ends (its open
        requests are aborted, as when a gRPC session's router goes away). When the server stops, the requests
        just end: the session sends what its requests still output, then ends."""
        try:
            while context.is_active():
                payload = recv_frame(conn)
                if payload is None:
                    if self._stopping.is_set():
                        return  # stop(): no abort, the handler flushes and ends
                    break
                yield parse(worker_pb2.SessionRequest, payload)
        except (OSError, FrameError) as exc:
            logger.info("socket session %s: read ended: %s", context.peer(), exc)
        context.end()
        try:  # wake the sender too: a peer gone without closing (reset) is seen here first
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _close(sock: socket.socket, linger: bool = False) -> None:
    """Close a connection; with `linger` (a stopping server's last sends) end the sending side first and give
    the peer a moment to take the tail, since closing with unread input resets the connection, which can drop
    output still in flight."""
    if linger:
        try:
            sock.shutdown(socket.SHUT_WR)
            time.sleep(LINGER_S)
        except OSError:
            pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
