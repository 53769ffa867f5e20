"""The socket session's wire format: length-prefixed protobuf frames on one TCP (or TLS) stream.

A frame is a 4-byte big-endian payload length, then one serialized message (`SessionHello` /
`SessionHelloReply` once each way, then `SessionRequest` router -> worker and `SessionEvents` worker -> router).
Hand-written rather than a messaging library: the session needs nothing but ordered frames on one connection,
and every library layer (gRPC's completion queues, ZeroMQ's I/O thread) adds a thread hand-off per message,
which is what this transport exists to avoid (bench/results/cpu/router/, the router's HTTP door).
"""

from __future__ import annotations

import socket
import struct
import time

from google.protobuf.message import DecodeError, Message

from hybridserve.proto.channels import MAX_MESSAGE_BYTES

VERSION = 1  # SessionHello.version the router sends; a worker refuses others with FAILED_PRECONDITION
HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES  # the same limit as a gRPC message
MAX_HELLO_BYTES = 4096  # a hello is a token and a version: a peer not yet authenticated gets no more


KEEPALIVE_IDLE_S = 60  # an idle session's TCP probes start after this long,
KEEPALIVE_INTERVAL_S = 10  # repeat this often,
KEEPALIVE_PROBES = 6  # and this many unanswered ones end it: a vanished peer is noticed in ~2 minutes


def keep_alive(sock: socket.socket) -> None:
    """Low-latency, self-checking session socket: no Nagle delay on small frames, TCP keepalive probes so a
    peer whose host vanished (no FIN, no reset) ends the session instead of holding it, and its requests,
    forever. The probe timings are Linux's options; other systems keep their defaults."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                        ("TCP_USER_TIMEOUT", 1000 * KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class FrameError(ValueError):
    """A frame that is too large or does not parse: the connection cannot be trusted past it."""


def encode(message: Message) -> bytes:
    """One frame holding `message`."""
    payload = message.SerializeToString()
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"a {type(message).__name__} of {len(payload)} bytes is over the {MAX_FRAME_BYTES}-byte "
                         "frame limit")
    return HEADER.pack(len(payload)) + payload


def payload_length(header: bytes, limit: int = MAX_FRAME_BYTES) -> int:
    """The payload length a frame header announces; FrameError past `limit` (a peer that speaks another
    protocol, or a corrupt stream)."""
    (length,) = HEADER.unpack(header)
    if length > limit:
        raise FrameError(f"a frame announces {length} bytes, over the {limit}-byte limit (is the peer a "
                         "hybridserve socket session?)")
    return length


def parse(cls: type[Message], payload: bytes | memoryview) -> Message:
    """`payload` parsed as a `cls`; FrameError if it is not one."""
    message = cls()
    try:
        message.ParseFromString(bytes(payload))
    except DecodeError as exc:
        raise FrameError(f"a frame does not parse as {cls.__name__}: {exc}") from exc
    return message


class FrameSplitter:
    """Cuts frames out of a byte stream that arrives in arbitrary pieces (the asyncio side's `data_received`)."""

    __slots__ = ("_buffer", "_need")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._need = -1  # payload length of the frame being read; -1: its header is not complete yet

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads completed by `data`, in order; FrameError on an oversized frame."""
        buffer = self._buffer
        buffer += data
        out: list[bytes] = []
        start = 0
        while True:
            if self._need < 0:
                if len(buffer) - start < HEADER.size:
                    break
                self._need = payload_length(bytes(buffer[start:start + HEADER.size]))
                start += HEADER.size
            if len(buffer) - start < self._need:
                break
            out.append(bytes(buffer[start:start + self._need]))
            start += self._need
            self._need = -1
        if start:
            del buffer[:start]
        return out


def recv_exactly(sock: socket.socket, count: int, deadline: float | None = None) -> bytes | None:
    """`count` bytes from a blocking socket; None if the peer closed before the first byte of them, FrameError
    if it closed in the middle; TimeoutError past `deadline` (time.monotonic()), if given, for all of them."""
    view = memoryview(bytearray(count))
    got = 0
    while got < count:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {count} bytes arrived before the deadline")
            sock.settimeout(left)
        n = sock.recv_into(view[got:], count - got)
        if n == 0:
            if got == 0:
                return None
            raise FrameError(f"the peer closed the connection in the middle of a frame ({got} of {count} bytes)")
        got += n
    return bytes(view)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES, deadline: float | None = None) -> bytes | None:
    """The next frame's payload from a blocking socket; None when the peer closed between frames; FrameError
    for a frame over `limit` bytes (nothing of it is read or allocated); TimeoutError past `deadline`."""
    header = recv_exactly(sock, HEADER.size, deadline)
    if header is None:
        return None
    length = payload_length(header, limit)
    if length == 0:
        return b""
    payload = recv_exactly(sock, length, deadline)
    if payload is None:
        raise FrameError("the peer closed the connection after a frame header")
    return payload
