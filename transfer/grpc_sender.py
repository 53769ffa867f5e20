"""Encode a request's state as a PushState stream: manifest, checksummed data chunks, trailer with a digest.

Parts are copied device->host one part ahead of the chunk being sent (a side CUDA stream into pinned
buffers), so the copy of part i+1 overlaps the send of part i. A part may come as a `ReadyPart` with the event
its bytes are final after: its copy waits for that event only (not for the producer's whole stream), which
lets a stream carry the KV of finished prefill chunks while later chunks still compute.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import crc32c
import torch

from hybridserve.proto import worker_pb2
from hybridserve.transfer.digest import StreamDigest
from hybridserve.transfer.grpc_wire import encode_data_chunk
from hybridserve.transfer.manifest import StateHeader, build_manifest
from hybridserve.transfer.state_layout import StateTensorSpec

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: well under gRPC's default 4 MiB message limit


@dataclass(frozen=True)
class ReadyPart:
    """A part whose bytes are final once `ready` completed (None: once queued work on the current stream did)."""

    tensor: torch.Tensor
    ready: torch.cuda.Event | None


def _as_bytes(host: torch.Tensor) -> memoryview:
    return host.view(torch.uint8).numpy().data.cast("B").toreadonly()


def host_parts(parts: Iterable[torch.Tensor | ReadyPart]) -> Iterator[memoryview]:
    """Contiguous host bytes of each part, in order; CUDA parts are copied one ahead on a side stream."""
    pending: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
    event: torch.cuda.Event | None
    stream = None
    for item in parts:
        part, ready = (item.tensor, item.ready) if isinstance(item, ReadyPart) else (item, None)
        if part.device.type == "cuda":
            if stream is None:
                stream = torch.cuda.Stream(device=part.device)
            if ready is not None:
                stream.wait_event(ready)
            else:
                stream.wait_stream(torch.cuda.current_stream(part.device))
            host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(part, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            pending.append((host, event))
        else:
            pending.append((part.contiguous(), None))
        if len(pending) > 1:  # hand over the previous part while this one copies
            yield _ready(*pending.pop(0))
    for host, event in pending:
        yield _ready(host, event)


def _ready(host: torch.Tensor, event: torch.cuda.Event | None) -> memoryview:
    if event is not None:
        event.synchronize()
    return _as_bytes(host)


def _chunked(views: Iterable[memoryview], chunk_bytes: int) -> Iterator[memoryview | bytes]:
    """Re-cut a stream of byte views into payloads of exactly chunk_bytes (the last may be shorter); whole
    payloads inside one view are zero-copy slices of it, payloads that straddle views are joined."""
    carry = bytearray()
    for view in views:
        offset = 0
        if carry:
            take = min(chunk_bytes - len(carry), len(view))
            carry += view[:take]
            offset = take
            if len(carry) < chunk_bytes:
                continue
            yield bytes(carry)
            carry = bytearray()
        while len(view) - offset >= chunk_bytes:
            yield view[offset : offset + chunk_bytes]
            offset += chunk_bytes
        carry += view[offset:]
    if carry:
        yield bytes(carry)


def _data_messages(
    specs: list[StateTensorSpec], parts: Iterable[torch.Tensor | ReadyPart], chunk_bytes: int, pre_encoded: bool
) -> Iterator[tuple[int, int, worker_pb2.StateChunk | bytes]]:
    """(index, crc32c, message) of every data chunk in order; checks the parts add up to the specs."""
    total = sum(spec.nbytes for spec in specs)
    index = sent = 0
    for payload in _chunked(host_parts(parts), chunk_bytes):
        crc = crc32c.crc32c(payload)
        if pre_encoded:
            message: worker_pb2.StateChunk | bytes = encode_data_chunk(index, crc, payload)
        else:
            message = worker_pb2.StateChunk(data=worker_pb2.StateData(index=index, payload=bytes(payload), crc32c=crc))
        yield index, crc, message
        index += 1
        sent += len(payload)
    if sent != total:
        raise ValueError(f"state parts hold {sent} bytes but the specs describe {total}")


def encode_state(
    header: StateHeader,
    specs: list[StateTensorSpec],
    parts: Iterable[torch.Tensor],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    pre_encoded: bool = False,
) -> Iterator[worker_pb2.StateChunk | bytes]:
    """One PushState stream: manifest, data chunks of at most `chunk_bytes`, trailer. With `pre_encoded`
    data chunks come as their wire bytes (one copy; send them through `grpc_wire.push_state_stub`)."""
    return encode_state_streams(header, specs, parts, chunk_bytes, pre_encoded, num_streams=1)[0]


def encode_state_streams(
    header: StateHeader,
    specs: list[StateTensorSpec],
    parts: Iterable[torch.Tensor | ReadyPart],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    pre_encoded: bool = False,
    num_streams: int = 1,
) -> list[Iterator[worker_pb2.StateChunk | bytes]]:
    """`num_streams` PushState streams striping the chunks (stream s carries chunks s, s + n, ...), sent in
    parallel over separate connections: one gRPC stream in Python tops out well below the socket's rate.
    A producer thread reads the parts once and deals the chunks out; its failure fails every stream."""
    if chunk_bytes <= 0 or num_streams <= 0:
        raise ValueError(f"chunk_bytes and num_streams must be positive, got {chunk_bytes}, {num_streams}")
    manifest = build_manifest(header, specs, chunk_bytes, num_streams)
    if num_streams == 1:
        return [_single_stream(manifest, _data_messages(specs, parts, chunk_bytes, pre_encoded))]
    queues: list[queue.Queue] = [queue.Queue(maxsize=_STRIPE_QUEUE) for _ in range(num_streams)]
    abandoned = threading.Event()

    def produce() -> None:
        try:
            for index, crc, message in _data_messages(specs, parts, chunk_bytes, pre_encoded):
                if not _put(queues[index % num_streams], (crc, message), abandoned):
                    return
            end = _End()
            for q in queues:
                _put(q, end, abandoned)
        except BaseException as exc:  # handed to every stream
            for q in queues:
                _put(q, exc, abandoned)

    threading.Thread(target=produce, name="state-stripes", daemon=True).start()
    return [_stripe(manifest, s, queues[s], abandoned) for s in range(num_streams)]


_STRIPE_QUEUE = 8


class _End:
    """The last item of a stripe's queue."""


def _put(q: queue.Queue, item: object, abandoned: threading.Event) -> bool:
    while not abandoned.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _trailer(digest: StreamDigest) -> worker_pb2.StateChunk:
    return worker_pb2.StateChunk(trailer=worker_pb2.StateTrailer(digest=digest.value))


def _single_stream(
    manifest: worker_pb2.StateManifest, data: Iterator[tuple[int, int, worker_pb2.StateChunk | bytes]],
) -> Iterator[worker_pb2.StateChunk | bytes]:
    yield worker_pb2.StateChunk(manifest=manifest)
    digest = StreamDigest()
    for _, crc, message in data:
        digest.add(crc)
        yield message
    yield _trailer(digest)


def _stripe(
    manifest: worker_pb2.StateManifest, stream_index: int, source: queue.Queue, abandoned: threading.Event
) -> Iterator[worker_pb2.StateChunk | bytes]:
    own = worker_pb2.StateManifest()
    own.CopyFrom(manifest)
    own.stream_index = stream_index
    completed = False
    try:
        yield worker_pb2.StateChunk(manifest=own)
        digest = StreamDigest()
        while not isinstance(item := source.get(), _End):
            if isinstance(item, BaseException):
                raise item
            crc, message = item
            digest.add(crc)
            yield message
        yield _trailer(digest)
        completed = True
    finally:
        if not completed:  # the call was cancelled or failed: stop the producer
            abandoned.set()
