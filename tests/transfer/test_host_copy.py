"""The gRPC plane's host copies: messages built without the GIL equal protobuf's encoding, payload writes land
where they belong, and a chunk index outside the state is refused before any byte is written."""

from __future__ import annotations

import pytest
import torch

from hybridserve.proto import worker_pb2
from hybridserve.transfer.grpc_receiver import StateAssembly
from hybridserve.transfer.grpc_wire import decode_state_chunk, encode_data_chunk
from hybridserve.transfer.host_copy import copy_bytes, keep_freed_host_memory, new_message
from hybridserve.transfer.manifest import TransferError
from hybridserve.transfer.state_layout import StateTensorSpec


@pytest.mark.parametrize("size", [0, 7, 65535, 65536, 1 << 20, (1 << 20) + 3])
def test_new_message_equals_the_joined_bytes(size: int) -> None:
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
    message = new_message(b"\x12\x34", memoryview(payload), b"\x56")
    assert type(message) is bytes and message == b"\x12\x34" + payload + b"\x56"
    assert hash(message) == hash(b"\x12\x34" + payload + b"\x56")


@pytest.mark.parametrize("size", [5, 1 << 20])
def test_data_chunk_is_protobufs_encoding(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    ours = encode_data_chunk(3, 0xDEADBEEF, memoryview(payload))
    theirs = worker_pb2.StateChunk(data=worker_pb2.StateData(index=3, payload=payload, crc32c=0xDEADBEEF))
    assert ours == theirs.SerializeToString()
    decoded = decode_state_chunk(ours)
    assert (decoded.index, decoded.crc32c, bytes(decoded.payload)) == (3, 0xDEADBEEF, payload)


def test_copy_bytes_writes_at_the_address() -> None:
    dst = torch.zeros(16, dtype=torch.uint8)
    copy_bytes(dst.data_ptr() + 4, memoryview(b"\x01\x02\x03"))
    copy_bytes(dst.data_ptr(), b"")
    assert dst.tolist() == [0] * 4 + [1, 2, 3] + [0] * 9


def test_assembly_refuses_a_chunk_outside_the_state() -> None:
    spec = StateTensorSpec("ssm", torch.float32, (4, 8))
    manifest = worker_pb2.StateManifest(total_bytes=spec.nbytes, chunk_bytes=64, num_chunks=2, num_streams=1)
    assembly = StateAssembly(manifest, [spec])
    assembly.write(1, memoryview(bytes(range(64))))
    assert assembly.buffer[64:].tolist() == list(range(64))
    for index in (2, -1):
        with pytest.raises(TransferError, match="outside"):
            assembly.write(index, memoryview(bytes(64)))


def test_keep_freed_host_memory_is_idempotent() -> None:
    assert keep_freed_host_memory() is keep_freed_host_memory()
