"""The raw TCP data plane: the decode worker reads an offered range of the prefill worker's staging arena over
a plain socket, straight into its landing memory.

Python gRPC copies every message twice more per side while holding the GIL (building the message bytes,
cygrpc's slice copy; on receipt the bytes object and the write into the state), which keeps the gRPC plane
well below what the socket carries. Here the bytes go arena -> socket -> landing buffer: `sendall` and
`recv_into` release the GIL, and a CUDA arena is copied through two pinned pieces that alternate, so the
device copy of one piece overlaps the network of the other. gRPC stays the control plane (OfferState with
the manifest, fingerprint and device digest); the source serves only ranges that are on offer right now and
only to a peer that knows the offer's random token.
"""

from __future__ import annotations

import logging
import pickle
import secrets
import socket
import struct
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hybridserve.transfer.arena import Arena, ArenaRange
from hybridserve.transfer.manifest import TransferError
from hybridserve.transfer.planes import TCP

logger = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20  # device <-> pinned copies of a CUDA arena go in pieces of this size, two alternating
SOCKET_TIMEOUT_S = 60.0
_REQUEST = struct.Struct("<16sQQ")  # token, offset, nbytes
_OK, _REFUSED = b"\x00", b"\x01"


def _pieces(nbytes: int) -> Iterator[tuple[int, int]]:
    for start in range(0, nbytes, PIECE_BYTES):
        yield start, min(PIECE_BYTES, nbytes - start)


def _host_view(data: torch.Tensor) -> memoryview:
    return data.numpy().data.cast("B")


class TcpSource:
    """The sending side: a listener that serves offered ranges of the staging arena."""

    plane = TCP

    def __init__(self, arena: Arena, host: str = "127.0.0.1") -> None:
        self.arena = arena
        self.source_id = f"tcp-{uuid.uuid4().hex}"
        self._token = secrets.token_bytes(16)
        self._offered: dict[tuple[int, int], int] = {}  # (offset, nbytes) -> how many offers hold it
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, 0), backlog=64)
        advertised = host if host not in ("", "0.0.0.0", "::") else socket.getfqdn()
        self._descriptor = pickle.dumps({"host": advertised, "port": self._listener.getsockname()[1],
                                         "token": self._token, "nbytes": arena.capacity})
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name=f"{self.source_id}-accept", daemon=True).start()

    def descriptor(self) -> bytes:
        return self._descriptor

    @contextmanager
    def exposed(self, offset: int, nbytes: int) -> Iterator[None]:
        """The range may be read while the block is on offer (the sender's OfferState call)."""
        key = (offset, nbytes)
        with self._lock:
            self._offered[key] = self._offered.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._offered[key] -= 1
                if not self._offered[key]:
                    del self._offered[key]

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.source_id}-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(SOCKET_TIMEOUT_S)
                token, offset, nbytes = _REQUEST.unpack(_recv_exactly(conn, _REQUEST.size))
                with self._lock:
                    allowed = secrets.compare_digest(token, self._token) and (offset, nbytes) in self._offered
                if not allowed:
                    conn.sendall(_REFUSED)
                    return
                conn.sendall(_OK)
                data = self.arena.buffer[offset : offset + nbytes]
                if data.device.type == "cuda":
                    self._send_device(conn, data)
                else:
                    conn.sendall(_host_view(data))
            except (OSError, ValueError) as exc:  # the reader went away or sent garbage: its fetch fails
                logger.debug("tcp plane: a read of %s ended early: %s", self.source_id, exc)

    def _send_device(self, conn: socket.socket, data: torch.Tensor) -> None:
        """Pinned pieces, two alternating: piece i+1 is copied down while piece i is sent."""
        stream = torch.cuda.Stream(data.device)
        pinned = [torch.empty(min(PIECE_BYTES, data.numel()), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        pending: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        with torch.cuda.stream(stream):
            for i, (start, size) in enumerate(_pieces(data.numel())):
                host = pinned[i % 2][:size]  # its previous piece (i - 2) was sent below
                host.copy_(data[start : start + size], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                pending.append((host, event))
                if len(pending) == 2:  # send piece i - 1 while piece i copies down
                    self._send_ready(conn, *pending.pop(0))
            for host, event in pending:
                self._send_ready(conn, host, event)

    @staticmethod
    def _send_ready(conn: socket.socket, host: torch.Tensor, event: torch.cuda.Event) -> None:
        event.synchronize()
        conn.sendall(_host_view(host))

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


class TcpSink:
    """The receiving side: reads offered ranges into landing blocks (pinned pieces on CUDA)."""

    plane = TCP

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def fetch(self, source_id: str, descriptor: bytes, offset: int, block: ArenaRange) -> None:
        """Read the sender's bytes [offset, offset + block.nbytes) into `block`; on CUDA the last piece's copy
        is queued on the current stream (the caller's digest check waits for it)."""
        try:
            info = pickle.loads(descriptor)
            address, token, capacity = (info["host"], info["port"]), info["token"], info["nbytes"]
        except Exception as exc:
            raise TransferError("INVALID_ARGUMENT", f"malformed tcp plane descriptor: {exc}") from exc
        if offset < 0 or offset + block.nbytes > capacity:
            raise TransferError("INVALID_ARGUMENT", f"offer range {offset}+{block.nbytes} is outside the sender's arena")
        try:
            conn = socket.create_connection(address, timeout=SOCKET_TIMEOUT_S)
        except OSError as exc:
            raise TransferError("FAILED_PRECONDITION", f"cannot reach the sender's tcp plane at {address}: {exc}") from exc
        with conn:
            try:
                conn.sendall(_REQUEST.pack(token, offset, block.nbytes))
                if _recv_exactly(conn, 1) != _OK:
                    raise TransferError("FAILED_PRECONDITION", "the sender refused the read (offer withdrawn?)")
                if block.data.device.type == "cuda":
                    self._receive_device(conn, block.data)
                else:
                    _recv_into(conn, _host_view(block.data))
            except (OSError, ValueError) as exc:
                raise TransferError("UNAVAILABLE", f"tcp plane read failed (the sender went away?): {exc}") from exc

    @staticmethod
    def _receive_device(conn: socket.socket, data: torch.Tensor) -> None:
        """Pinned pieces, two alternating: piece i is copied up while piece i+1 arrives."""
        stream = torch.cuda.current_stream(data.device)
        pinned = [torch.empty(min(PIECE_BYTES, data.numel()), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        copied: list[torch.cuda.Event | None] = [None, None]
        for i, (start, size) in enumerate(_pieces(data.numel())):
            host = pinned[i % 2][:size]
            previous = copied[i % 2]
            if previous is not None:
                previous.synchronize()  # its previous piece has left for the device
            _recv_into(conn, _host_view(host))
            data[start : start + size].copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            copied[i % 2] = event
        for last in copied:  # the pinned pieces must outlive their copies
            if last is not None:
                last.synchronize()

    def close(self) -> None:
        pass


def _recv_exactly(conn: socket.socket, nbytes: int) -> bytes:
    data = conn.recv(nbytes, socket.MSG_WAITALL)
    if len(data) != nbytes:
        raise ValueError(f"connection closed after {len(data)} of {nbytes} bytes")
    return data


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], len(view) - got)
        if n == 0:
            raise ValueError(f"connection closed after {got} of {len(view)} bytes")
        got += n
