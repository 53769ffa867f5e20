"""PushState encoding and checking: a round trip is exact; damage of any kind is refused."""

from __future__ import annotations

import pytest
import torch

from hybridserve.proto import worker_pb2
from hybridserve.transfer.grpc_receiver import receive_state
from hybridserve.transfer.grpc_sender import encode_state
from hybridserve.transfer.manifest import StateHeader, TransferError, check_manifest
from hybridserve.transfer.state_layout import StateTensorSpec

HEADER = StateHeader(ticket="t-1", request_id="r-1", model_fingerprint="fp", num_tokens=9, first_token=5, num_cached_tokens=0)


def _state() -> tuple[list[StateTensorSpec], dict[str, torch.Tensor]]:
    tensors = {
        "kv.k": torch.randn(2, 9, 2, 8).to(torch.bfloat16),
        "kv.v": torch.randn(2, 9, 2, 8).to(torch.bfloat16),
        "conv": torch.randn(3, 40, 3).to(torch.bfloat16),
        "ssm": torch.randn(3, 4, 8, 6),
        "hidden": torch.randn(32).to(torch.bfloat16),
    }
    specs = [StateTensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    return specs, tensors


def _parts(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [layer for t in tensors.values() for layer in (t if t.dim() > 1 else [t])]


def _check(specs):
    return lambda manifest: (check_manifest(manifest, "t-1", "fp", 9, specs), specs)[1]


@pytest.mark.parametrize("chunk_bytes", [7, 100, 1 << 20])
def test_round_trip_is_exact(chunk_bytes: int) -> None:
    specs, tensors = _state()
    messages = list(encode_state(HEADER, specs, _parts(tensors), chunk_bytes))
    assert messages[0].WhichOneof("body") == "manifest" and messages[-1].WhichOneof("body") == "trailer"
    assert all(len(m.data.payload) <= chunk_bytes for m in messages[1:-1])
    received = receive_state(iter(messages), _check(specs))
    for name, tensor in tensors.items():
        assert torch.equal(received.tensors[name], tensor), name
    assert received.manifest.first_token == 5


def _messages(chunk_bytes: int = 64):
    specs, tensors = _state()
    return specs, list(encode_state(HEADER, specs, _parts(tensors), chunk_bytes))


def test_corrupted_chunk_is_refused() -> None:
    specs, messages = _messages()
    payload = bytearray(messages[3].data.payload)
    payload[5] ^= 0xFF
    messages[3].data.payload = bytes(payload)
    with pytest.raises(TransferError, match="crc32c") as info:
        receive_state(iter(messages), _check(specs))
    assert info.value.code == "DATA_LOSS"


def test_truncated_stream_is_refused() -> None:
    specs, messages = _messages()
    with pytest.raises(TransferError, match="no trailer"):
        receive_state(iter(messages[:-3]), _check(specs))


def test_missing_or_reordered_chunk_is_refused() -> None:
    specs, messages = _messages()
    with pytest.raises(TransferError, match="expected chunk 2"):
        receive_state(iter(messages[:3] + messages[4:]), _check(specs))


def test_forged_digest_is_refused() -> None:
    specs, messages = _messages()
    messages[-1].trailer.digest ^= 1
    with pytest.raises(TransferError, match="digest"):
        receive_state(iter(messages), _check(specs))


@pytest.mark.parametrize(
    "field, value, match",
    [("model_fingerprint", "other-model", "model"), ("ticket", "t-2", "ticket"), ("num_tokens", 10, "tokens")],
)
def test_manifest_from_elsewhere_is_refused(field: str, value, match: str) -> None:
    specs, messages = _messages()
    setattr(messages[0].manifest, field, value)
    with pytest.raises(TransferError, match=match):
        receive_state(iter(messages), _check(specs))


def test_shape_mismatch_is_refused() -> None:
    specs, messages = _messages()
    wrong = [StateTensorSpec(s.name, s.dtype, (s.shape[0] + 1, *s.shape[1:])) if s.name == "ssm" else s for s in specs]
    with pytest.raises(TransferError, match="do not match"):
        receive_state(iter(messages), _check(wrong))


def test_stream_must_start_with_manifest() -> None:
    specs, messages = _messages()
    with pytest.raises(TransferError, match="start with its manifest"):
        receive_state(iter(messages[1:]), _check(specs))
    with pytest.raises(TransferError, match="start with its manifest"):
        receive_state(iter([]), _check(specs))
    extra = messages + [worker_pb2.StateChunk(trailer=worker_pb2.StateTrailer())]
    with pytest.raises(TransferError, match="after the trailer"):
        receive_state(iter(extra), _check(specs))


def test_striped_streams_reassemble_exactly() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from hybridserve.transfer.grpc_receiver import StateAssembly, receive_stream
    from hybridserve.transfer.grpc_sender import encode_state_streams

    specs, tensors = _state()
    streams = encode_state_streams(HEADER, specs, _parts(tensors), chunk_bytes=100, pre_encoded=True, num_streams=3)
    shared: list[StateAssembly] = []

    def open_assembly(manifest):
        check_manifest(manifest, "t-1", "fp", 9, specs)
        if not shared:
            shared.append(StateAssembly(manifest, specs))
        assert shared[0].same_state(manifest)
        return shared[0]

    from hybridserve.transfer.grpc_wire import decode_state_chunk

    def consume(stream):
        wire = (m if isinstance(m, bytes) else m.SerializeToString() for m in stream)
        return receive_stream((decode_state_chunk(raw) for raw in wire), open_assembly)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(consume, streams))
    assert sum(complete for _, complete, _ in results) == 1
    assert sum(n for _, _, n in results) == sum(s.nbytes for s in specs)
    received = shared[0].result()
    for name, tensor in tensors.items():
        assert torch.equal(received.tensors[name], tensor), name


def test_a_stripe_with_another_streams_chunk_is_refused() -> None:
    from hybridserve.transfer.grpc_receiver import StateAssembly, receive_stream
    from hybridserve.transfer.grpc_sender import encode_state_streams

    specs, tensors = _state()
    # few chunks, so the producer never waits on the stream this test reads second
    first, second = encode_state_streams(HEADER, specs, _parts(tensors), chunk_bytes=500, num_streams=2)
    messages = list(first)
    messages[2] = next(m for m in list(second) if m.WhichOneof("body") == "data")
    with pytest.raises(TransferError, match="expected chunk"):
        receive_stream(iter(messages), lambda m: StateAssembly(m, specs))
