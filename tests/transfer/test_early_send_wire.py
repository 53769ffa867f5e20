"""The wire of an early-sent state (gRPC plane, `tail_in_trailer`): first token, cached tokens and the device digest
travel in every stream's trailer; a missing or inconsistent tail is INVALID_ARGUMENT, a wrong digest DATA_LOSS."""

from __future__ import annotations

import pytest
import torch

from hybridserve.proto import worker_pb2
from hybridserve.transfer.grpc_receiver import StateAssembly, receive_stream
from hybridserve.transfer.grpc_sender import encode_state_streams
from hybridserve.transfer.manifest import StateHeader, TransferError
from hybridserve.transfer.planes import TransferConfig
from hybridserve.transfer.receiver import StateReceiver
from hybridserve.transfer.state_layout import StateTensorSpec


def _early_streams(tails: list[worker_pb2.StateTail | None], num_streams: int = 2):
    """Streams of a small state whose trailers carry `tails` (one per stream; None: no tail)."""
    kv, ssm = torch.randn(9, 2, 2, 2, 8), torch.randn(3, 4, 8, 6)
    specs = [StateTensorSpec("kv", kv.dtype, tuple(kv.shape)), StateTensorSpec("ssm", ssm.dtype, tuple(ssm.shape))]
    header = StateHeader("t-1", "r-1", "fp", 9, 0, 0)
    # 9 chunks of 512 bytes: each stripe fits its producer queue, so the streams can be read one after another
    streams = encode_state_streams(header, specs, [kv, ssm], 512, num_streams=num_streams,
                                   tail=lambda: worker_pb2.StateTail(first_token=7, num_cached_tokens=3))
    messages = [list(s) for s in streams]
    for stream, tail in zip(messages, tails):
        stream[-1].trailer.ClearField("tail")
        if tail is not None:
            stream[-1].trailer.tail.CopyFrom(tail)
    return specs, {"kv": kv, "ssm": ssm}, messages


def _receive(specs, messages):
    assemblies: list[StateAssembly] = []

    def open_assembly(manifest):
        if not assemblies:
            assemblies.append(StateAssembly(manifest, specs))
        return assemblies[0]

    results = [receive_stream(iter(stream), open_assembly) for stream in messages]
    return assemblies[0], results[-1][1]


def test_the_trailers_tail_completes_the_manifest() -> None:
    tail = worker_pb2.StateTail(first_token=7, num_cached_tokens=3)
    specs, tensors, messages = _early_streams([tail, tail])
    assert messages[0][0].manifest.tail_in_trailer and messages[0][0].manifest.first_token == 0
    assembly, complete = _receive(specs, messages)
    assert complete and assembly.manifest.first_token == 7 and assembly.manifest.num_cached_tokens == 3
    received = assembly.result().tensors
    assert all(torch.equal(received[name], t) for name, t in tensors.items())


@pytest.mark.parametrize("fault", ["missing", "different"])
def test_a_missing_or_inconsistent_tail_is_refused(fault: str) -> None:
    tail = worker_pb2.StateTail(first_token=7, num_cached_tokens=3)
    other = worker_pb2.StateTail(first_token=8, num_cached_tokens=3)
    specs, _, messages = _early_streams([tail, None if fault == "missing" else other])
    with pytest.raises(TransferError, match="tail") as info:
        _receive(specs, messages)
    assert info.value.code == "INVALID_ARGUMENT"


def test_a_wrong_device_digest_in_the_tail_is_data_loss() -> None:
    tail = worker_pb2.StateTail(first_token=7, num_cached_tokens=3, device_digest=12345)
    specs, _, messages = _early_streams([tail, tail])
    assembly, complete = _receive(specs, messages)
    assert complete
    with pytest.raises(TransferError, match="digest") as info:
        StateReceiver(TransferConfig(staging_mb=1), torch.device("cpu")).land_host(assembly)
    assert info.value.code == "DATA_LOSS"
