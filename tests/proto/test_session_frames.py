"""The socket session's frames (proto/session_frames.py): any cut of a stream of frames gives the same
messages; frames past the limit are refused on both ends; a closed peer is told apart from a cut frame."""

from __future__ import annotations

import random
import socket
import struct

import pytest

from hybridserve.proto import common_pb2, worker_pb2
from hybridserve.proto.session_frames import (
    HEADER,
    MAX_FRAME_BYTES,
    FrameError,
    FrameSplitter,
    encode,
    parse,
    recv_frame,
)


def _messages(n: int, seed: int) -> list[worker_pb2.SessionEvents]:
    rng = random.Random(seed)
    return [worker_pb2.SessionEvents(events=[common_pb2.TokenEvent(
        request_id=f"r{i}-{j}", token_ids=[rng.randrange(1 << 20) for _ in range(rng.randrange(40))])
        for j in range(rng.randrange(4))]) for i in range(n)]  # some empty: zero-length frames


@pytest.mark.parametrize("seed", range(5))
def test_any_cut_of_the_stream_gives_the_same_messages(seed: int) -> None:
    messages = _messages(30, seed)
    stream = b"".join(encode(m) for m in messages)
    rng = random.Random(seed)
    splitter, got = FrameSplitter(), []
    start = 0
    while start < len(stream):
        end = min(len(stream), start + rng.choice([1, 2, 3, 7, 64, 1000]))
        got += [parse(worker_pb2.SessionEvents, p) for p in splitter.feed(stream[start:end])]
        start = end
    assert got == messages


def test_oversized_and_unparsable_frames_are_refused() -> None:
    with pytest.raises(FrameError, match="limit"):
        FrameSplitter().feed(HEADER.pack(MAX_FRAME_BYTES + 1))
    with pytest.raises(FrameError, match="does not parse"):
        parse(worker_pb2.SessionRequest, b"\xff\xff\xff")
    big = worker_pb2.SessionEvents(events=[common_pb2.TokenEvent(error="x" * (MAX_FRAME_BYTES + 1))])
    with pytest.raises(FrameError, match="limit"):
        encode(big)


def test_blocking_reads_tell_a_closed_peer_from_a_cut_frame() -> None:
    message = worker_pb2.SessionHello(token="t", version=1)
    a, b = socket.socketpair()
    a.sendall(encode(message) + encode(message))
    a.close()
    assert parse(worker_pb2.SessionHello, recv_frame(b)) == message
    assert parse(worker_pb2.SessionHello, recv_frame(b)) == message
    assert recv_frame(b) is None  # closed between frames
    b.close()
    a, b = socket.socketpair()
    a.sendall(struct.pack(">I", 10) + b"12345")
    a.close()
    with pytest.raises(FrameError, match="middle of a frame"):
        recv_frame(b)
    b.close()
