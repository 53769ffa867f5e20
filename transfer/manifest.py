"""What every data plane agrees on before bytes move: the state's header, its manifest, and the checks the
decode side runs on it (ticket, model fingerprint, tensor layout, sizes). Each failure is a `TransferError`
naming the gRPC status to answer with; nothing is committed after one."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.proto import worker_pb2
from hybridserve.transfer.state_layout import StateTensorSpec


class TransferError(Exception):
    """A state stream that must not be committed; `code` names the gRPC status to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # a grpc.StatusCode name: "INVALID_ARGUMENT", "DATA_LOSS", "FAILED_PRECONDITION", ...


@dataclass(frozen=True)
class StateHeader:
    """What the manifest says besides the tensor specs."""

    ticket: str
    request_id: str
    model_fingerprint: str
    num_tokens: int
    first_token: int
    num_cached_tokens: int
    device_digest: int = 0  # digest.device_digest of the staged bytes (0: not computed)


def build_manifest(
    header: StateHeader, specs: list[StateTensorSpec], chunk_bytes: int = 0, num_streams: int = 1
) -> worker_pb2.StateManifest:
    """The manifest of a state; chunk fields describe a gRPC stream (chunk_bytes 0: a device-plane offer)."""
    total = sum(spec.nbytes for spec in specs)
    return worker_pb2.StateManifest(
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
        num_chunks=-(-total // chunk_bytes) if chunk_bytes else 0,
        chunk_bytes=chunk_bytes,
        num_streams=num_streams,
        device_digest=header.device_digest,
    )


def check_manifest(
    manifest: worker_pb2.StateManifest,
    ticket: str,
    fingerprint: str,
    num_tokens: int,
    specs: list[StateTensorSpec],
    chunked: bool = True,
) -> list[StateTensorSpec]:
    """Raise TransferError unless the manifest describes exactly the state the reservation expects; its specs."""
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
        raise TransferError(
            "INVALID_ARGUMENT",
            f"manifest tensors {got} do not match the expected {want}: prefill and decode workers need the same "
            "model, dtype and speculative_config (MTP adds drafter KV, speculation widens the conv windows)",
        )
    total = sum(s.nbytes for s in specs)
    if manifest.total_bytes != total:
        raise TransferError("INVALID_ARGUMENT", "manifest total_bytes does not match its tensors")
    streams = max(manifest.num_streams, 1)
    if manifest.stream_index >= streams:
        raise TransferError("INVALID_ARGUMENT", f"stream_index {manifest.stream_index} of {streams} streams")
    if chunked and total and (manifest.chunk_bytes == 0 or manifest.num_chunks != -(-total // manifest.chunk_bytes)):
        raise TransferError("INVALID_ARGUMENT", "manifest chunk_bytes / num_chunks do not describe total_bytes")
    return specs
