"""Encode a request's state as a PushState stream: manifest, checksummed data chunks, trailer with a digest.

Parts are copied device->host one layer ahead of the chunk being sent (a side CUDA stream into pinned
buffers), so the copy of layer i+1 overlaps the send of layer i.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import google_crc32c
import torch

from hybridserve.proto import worker_pb2
from hybridserve.statepool.request_state import StateTensorSpec

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: well under gRPC's default 4 MiB message limit


@dataclass(frozen=True)
class StateHeader:
    """What the manifest says besides the tensor specs."""

    ticket: str
    request_id: str
    model_fingerprint: str
    num_tokens: int
    first_token: int
    num_cached_tokens: int


def _as_bytes(host: torch.Tensor) -> memoryview:
    return memoryview(host.view(torch.uint8).numpy()).cast("B")


def host_parts(parts: Iterable[torch.Tensor]) -> Iterator[memoryview]:
    """Contiguous host bytes of each part, in order; CUDA parts are copied one ahead on a side stream."""
    pending: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
    stream = None
    for part in parts:
        if part.device.type == "cuda":
            if stream is None:
                stream = torch.cuda.Stream(device=part.device)
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


class StreamDigest:
    """crc32c over the chunks' crc32c values (little-endian u32, in order): one pass over the data per side."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, chunk_crc: int) -> None:
        self.value = google_crc32c.extend(self.value, chunk_crc.to_bytes(4, "little"))


def _chunked(views: Iterable[memoryview], chunk_bytes: int) -> Iterator[bytes]:
    """Re-cut a stream of byte views into payloads of exactly chunk_bytes (the last may be shorter),
    copying each byte once."""
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
            yield view[offset : offset + chunk_bytes].tobytes()
            offset += chunk_bytes
        carry += view[offset:]
    if carry:
        yield bytes(carry)


def encode_state(
    header: StateHeader,
    specs: list[StateTensorSpec],
    parts: Iterable[torch.Tensor],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[worker_pb2.StateChunk]:
    """The PushState messages: manifest, data chunks of at most `chunk_bytes`, trailer."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    total = sum(spec.nbytes for spec in specs)
    manifest = worker_pb2.StateManifest(
        ticket=header.ticket,
        request_id=header.request_id,
        model_fingerprint=header.model_fingerprint,
        num_tokens=header.num_tokens,
        first_token=header.first_token,
        num_cached_tokens=header.num_cached_tokens,
        tensors=[
            worker_pb2.TensorSpec(name=s.name, dtype=s.dtype_name, shape=list(s.shape), nbytes=s.nbytes) for s in specs
        ],
        total_bytes=total,
        num_chunks=-(-total // chunk_bytes),
    )
    yield worker_pb2.StateChunk(manifest=manifest)
    digest = StreamDigest()
    index = sent = 0
    for payload in _chunked(host_parts(parts), chunk_bytes):
        crc = google_crc32c.value(payload)
        digest.add(crc)
        yield worker_pb2.StateChunk(data=worker_pb2.StateData(index=index, payload=payload, crc32c=crc))
        index += 1
        sent += len(payload)
    if sent != total:
        raise ValueError(f"state parts hold {sent} bytes but the specs describe {total}")
    yield worker_pb2.StateChunk(trailer=worker_pb2.StateTrailer(digest=digest.value))
