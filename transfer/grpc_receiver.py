"""Receive PushState streams and check them completely before anything is committed.

A state may arrive striped over several parallel streams (stream s carries chunks s, s + n, ...); they share
one `StateAssembly`. Checks: each stream starts with a manifest that matches what the reservation expects
(ticket, model fingerprint, tensor names / dtypes / shapes, token count) and the other streams' manifests;
chunks arrive in the stream's order with intact crc32c and the right sizes; each trailer's digest matches
its stream's chunks; the state is complete only when every stream checked out. Any failure raises a
`TransferError` and nothing is written to the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import crc32c
import torch

from hybridserve.proto import worker_pb2
from hybridserve.transfer.digest import StreamDigest
from hybridserve.transfer.grpc_wire import RawStateData
from hybridserve.transfer.host_copy import copy_bytes
from hybridserve.transfer.manifest import TransferError
from hybridserve.transfer.state_layout import StateTensorSpec, state_views

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceivedState:
    manifest: worker_pb2.StateManifest
    tensors: dict[str, torch.Tensor]  # CPU tensors, views of one received buffer
    num_bytes: int


class ReceiveBuffers:
    """Reusable receive buffers. Fresh memory costs a page fault per 4 KiB on first write, which caps a
    copy near 1 GB/s on these machines; a reused buffer takes the same copy at memory speed."""

    def __init__(self, max_buffers: int = 4, pin_memory: bool = False) -> None:
        self._free: list[torch.Tensor] = []
        self._max = max_buffers
        self._pin = pin_memory
        self._lock = threading.Lock()

    def acquire(self, num_bytes: int) -> torch.Tensor:
        """A uint8 buffer of at least num_bytes (the smallest free one that fits, else a new one)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= num_bytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self._pin)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self._max:  # drop the smallest (tensors compare elementwise: pop by index)
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


class StateAssembly:
    """The receive buffer one state's streams write into, and which streams have checked out."""

    def __init__(
        self, manifest: worker_pb2.StateManifest, specs: list[StateTensorSpec], buffers: ReceiveBuffers | None = None
    ) -> None:
        self.manifest = worker_pb2.StateManifest()
        self.manifest.CopyFrom(manifest)
        self.manifest.stream_index = 0
        self.specs = specs
        self.num_streams = max(manifest.num_streams, 1)
        self._buffers = buffers
        storage = buffers.acquire(manifest.total_bytes) if buffers else torch.empty(manifest.total_bytes, dtype=torch.uint8)
        self._storage: torch.Tensor | None = storage
        self.buffer = storage[: manifest.total_bytes]
        self._address = self.buffer.data_ptr()
        self._done: set[int] = set()
        self._lock = threading.Lock()

    def same_state(self, manifest: worker_pb2.StateManifest) -> bool:
        other = worker_pb2.StateManifest()
        other.CopyFrom(manifest)
        other.stream_index = 0
        return other == self.manifest

    def write(self, index: int, payload: memoryview | bytes) -> None:
        m = self.manifest
        if not 0 <= index < m.num_chunks:
            raise TransferError("DATA_LOSS", f"chunk {index} is outside the state's {m.num_chunks} chunks")
        expected = m.chunk_bytes if index < m.num_chunks - 1 else m.total_bytes - m.chunk_bytes * (m.num_chunks - 1)
        if len(payload) != expected:
            raise TransferError("DATA_LOSS", f"chunk {index} has {len(payload)} bytes, expected {expected}")
        copy_bytes(self._address + index * m.chunk_bytes, payload)  # bounds: checked above; GIL released

    def finish_stream(self, stream_index: int) -> bool:
        """Mark a stream complete; True when it was the last one."""
        with self._lock:
            if stream_index in self._done:
                raise TransferError("INVALID_ARGUMENT", f"stream {stream_index} was sent twice")
            self._done.add(stream_index)
            return len(self._done) == self.num_streams

    def release(self) -> None:
        """Hand the buffer back for reuse (after the received tensors were copied out)."""
        if self._buffers is not None and self._storage is not None:
            self._buffers.release(self._storage)
            self._storage = None

    def result(self) -> ReceivedState:
        tensors = state_views(self.buffer, self.specs)
        return ReceivedState(manifest=self.manifest, tensors=tensors, num_bytes=self.manifest.total_bytes)


OpenAssembly = Callable[[worker_pb2.StateManifest], StateAssembly]


def receive_stream(
    chunks: Iterable[worker_pb2.StateChunk | RawStateData], open_assembly: OpenAssembly
) -> tuple[StateAssembly, bool, int]:
    """Consume one stream into its assembly; returns (assembly, state complete, bytes of this stream)."""
    iterator = iter(chunks)
    first = next(iterator, None)
    if first is None or isinstance(first, RawStateData) or first.WhichOneof("body") != "manifest":
        raise TransferError("INVALID_ARGUMENT", "a PushState stream must start with its manifest")
    manifest = first.manifest
    opened = time.time()
    assembly = open_assembly(manifest)
    streams = assembly.num_streams
    own_chunks = range(manifest.stream_index, manifest.num_chunks, streams)
    expected = iter(own_chunks)
    digest = StreamDigest()
    received = count = 0
    trailer = None
    for message in iterator:
        if isinstance(message, RawStateData):
            index, crc_sent, payload = message.index, message.crc32c, message.payload
        else:
            kind = message.WhichOneof("body")
            if kind == "trailer":
                trailer = message.trailer
                break
            if kind != "data":
                raise TransferError("INVALID_ARGUMENT", f"unexpected {kind!r} message after the manifest")
            index, crc_sent, payload = message.data.index, message.data.crc32c, message.data.payload
        want = next(expected, None)
        if index != want:
            raise TransferError("DATA_LOSS", f"chunk {index} arrived, expected chunk {want}")
        crc = crc32c.crc32c(payload)
        if crc != crc_sent:
            raise TransferError("DATA_LOSS", f"chunk {index} fails its crc32c check")
        assembly.write(index, payload)
        digest.add(crc)
        received += len(payload)
        count += 1
    if trailer is None:
        raise TransferError("DATA_LOSS", f"stream ended after {count} of {len(own_chunks)} chunks, no trailer")
    if next(iterator, None) is not None:
        raise TransferError("INVALID_ARGUMENT", "messages after the trailer")
    if count != len(own_chunks):
        raise TransferError("DATA_LOSS", f"stream carried {count} chunks, its share is {len(own_chunks)}")
    if trailer.digest != digest.value:
        raise TransferError("DATA_LOSS", "the stream digest does not match the payloads")
    if trailer.HasField("tail") or manifest.tail_in_trailer:  # the wire's field for states sent before they were whole
        raise TransferError("INVALID_ARGUMENT", "this worker takes whole states only: no tail in the trailer")
    logger.info("state stream %d/%d of %s: %.1f MiB in %.1f ms (opened at %.3f, trailer at %.3f)",
                manifest.stream_index, streams, manifest.request_id, received / 2**20, (time.time() - opened) * 1e3,
                opened, time.time())
    return assembly, assembly.finish_stream(manifest.stream_index), received


def receive_state(
    chunks: Iterable[worker_pb2.StateChunk | RawStateData],
    manifest_check: Callable[[worker_pb2.StateManifest], list[StateTensorSpec]],
) -> ReceivedState:
    """A whole state sent as one stream; `manifest_check(manifest)` returns the expected specs or raises."""

    def open_assembly(manifest: worker_pb2.StateManifest) -> StateAssembly:
        specs = manifest_check(manifest)
        if max(manifest.num_streams, 1) != 1:
            raise TransferError("INVALID_ARGUMENT", "this receiver takes a state as one stream")
        return StateAssembly(manifest, specs)

    assembly, complete, _ = receive_stream(chunks, open_assembly)
    if not complete:
        raise TransferError("DATA_LOSS", "the state is incomplete")
    return assembly.result()
