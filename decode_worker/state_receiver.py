"""Receive a PushState stream and check it completely before anything is committed.

Checks, in order: the manifest comes first and matches what the reservation expects (ticket, model
fingerprint, tensor names / dtypes / shapes, token count); chunks arrive with consecutive indices and
intact crc32c; the byte count and the trailer's digest over all payloads match. Any failure raises a
`TransferError` and leaves nothing written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import google_crc32c
import torch

from hybridserve.prefill_worker.state_sender import StreamDigest
from hybridserve.proto import worker_pb2
from hybridserve.statepool.request_state import StateTensorSpec


class TransferError(Exception):
    """A state stream that must not be committed; `code` names the gRPC status to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # "INVALID_ARGUMENT" | "DATA_LOSS" | "FAILED_PRECONDITION"


@dataclass(frozen=True)
class ReceivedState:
    manifest: worker_pb2.StateManifest
    tensors: dict[str, torch.Tensor]  # CPU tensors, views of one received buffer
    num_bytes: int


def check_manifest(
    manifest: worker_pb2.StateManifest, ticket: str, fingerprint: str, num_tokens: int, specs: list[StateTensorSpec]
) -> None:
    """Raise TransferError unless the manifest describes exactly the state the reservation expects."""
    if manifest.ticket != ticket:
        raise TransferError("FAILED_PRECONDITION", f"manifest ticket {manifest.ticket!r} is not {ticket!r}")
    if manifest.model_fingerprint != fingerprint:
        raise TransferError(
            "FAILED_PRECONDITION",
            f"state is from model {manifest.model_fingerprint!r}, this worker serves {fingerprint!r}",
        )
    if manifest.num_tokens != num_tokens:
        raise TransferError("INVALID_ARGUMENT", f"manifest has {manifest.num_tokens} tokens, reserved {num_tokens}")
    got = [(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in manifest.tensors]
    want = [(s.name, s.dtype_name, s.shape, s.nbytes) for s in specs]
    if got != want:
        raise TransferError("INVALID_ARGUMENT", f"manifest tensors {got} do not match the expected {want}")
    if manifest.total_bytes != sum(s.nbytes for s in specs):
        raise TransferError("INVALID_ARGUMENT", "manifest total_bytes does not match its tensors")


ManifestCheck = Callable[[worker_pb2.StateManifest], list[StateTensorSpec]]


def receive_state(chunks: Iterable[worker_pb2.StateChunk], manifest_check: ManifestCheck) -> ReceivedState:
    """Consume the whole stream; `manifest_check(manifest)` returns the expected specs or raises."""
    iterator = iter(chunks)
    first = next(iterator, None)
    if first is None or first.WhichOneof("body") != "manifest":
        raise TransferError("INVALID_ARGUMENT", "a PushState stream must start with its manifest")
    manifest = first.manifest
    specs = manifest_check(manifest)
    buffer = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy()).cast("B")
    offset, expected_index = 0, 0
    digest = StreamDigest()
    trailer = None
    for message in iterator:
        kind = message.WhichOneof("body")
        if kind == "trailer":
            trailer = message.trailer
            break
        if kind != "data":
            raise TransferError("INVALID_ARGUMENT", f"unexpected {kind!r} message after the manifest")
        data = message.data
        if data.index != expected_index:
            raise TransferError("DATA_LOSS", f"chunk {data.index} arrived, expected chunk {expected_index}")
        crc = google_crc32c.value(data.payload)
        if crc != data.crc32c:
            raise TransferError("DATA_LOSS", f"chunk {data.index} fails its crc32c check")
        end = offset + len(data.payload)
        if end > manifest.total_bytes:
            raise TransferError("DATA_LOSS", f"chunks carry more than the manifest's {manifest.total_bytes} bytes")
        view[offset:end] = data.payload
        digest.add(crc)
        offset, expected_index = end, expected_index + 1
    if trailer is None:
        raise TransferError("DATA_LOSS", f"stream ended after {offset} of {manifest.total_bytes} bytes, no trailer")
    if next(iterator, None) is not None:
        raise TransferError("INVALID_ARGUMENT", "messages after the trailer")
    if offset != manifest.total_bytes or expected_index != manifest.num_chunks:
        raise TransferError(
            "DATA_LOSS", f"received {offset} bytes in {expected_index} chunks, manifest says "
            f"{manifest.total_bytes} in {manifest.num_chunks}"
        )
    if trailer.digest != digest.value:
        raise TransferError("DATA_LOSS", "the stream digest does not match the payloads")
    tensors: dict[str, torch.Tensor] = {}
    start = 0
    for spec in specs:
        raw = buffer[start : start + spec.nbytes]
        if start % raw.new_empty((), dtype=spec.dtype).element_size():
            raw = raw.clone()  # dtype views need element-aligned offsets
        tensors[spec.name] = raw.view(spec.dtype).reshape(spec.shape)
        start += spec.nbytes
    return ReceivedState(manifest=manifest, tensors=tensors, num_bytes=offset)

