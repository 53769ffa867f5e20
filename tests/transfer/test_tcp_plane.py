"""The tcp data plane on its own: a read lands the offered bytes exactly; a range that is not on offer, a
wrong token, a range outside the arena and a source that went away fail with clean statuses."""

from __future__ import annotations

import pickle

import pytest
import torch

from hybridserve.transfer.arena import Arena
from hybridserve.transfer.manifest import TransferError
from hybridserve.transfer.tcp_plane import TcpSink, TcpSource


@pytest.fixture()
def source_and_block():
    arena = Arena(1 << 20)
    block = arena.allocate(300_001)
    block.data.copy_(torch.randint(0, 256, (block.nbytes,), dtype=torch.uint8))
    source = TcpSource(arena)
    yield source, block
    source.close()


def test_an_offered_range_lands_exactly(source_and_block) -> None:
    source, block = source_and_block
    landing = Arena(1 << 20).allocate(block.nbytes)
    with source.exposed(block.offset, block.nbytes):
        TcpSink(torch.device("cpu")).fetch(source.source_id, source.descriptor(), block.offset, landing)
    assert torch.equal(landing.data, block.data)


def test_only_offered_ranges_are_served_to_token_holders(source_and_block) -> None:
    source, block = source_and_block
    sink, landing = TcpSink(torch.device("cpu")), Arena(1 << 20).allocate(block.nbytes)
    with pytest.raises(TransferError, match="refused") as info:  # not on offer (any more)
        sink.fetch(source.source_id, source.descriptor(), block.offset, landing)
    assert info.value.code == "FAILED_PRECONDITION"
    forged = pickle.loads(source.descriptor())
    forged["token"] = bytes(16)
    with source.exposed(block.offset, block.nbytes), pytest.raises(TransferError, match="refused"):
        sink.fetch(source.source_id, pickle.dumps(forged), block.offset, landing)
    with pytest.raises(TransferError, match="outside") as info:
        sink.fetch(source.source_id, source.descriptor(), 1 << 20, landing)
    assert info.value.code == "INVALID_ARGUMENT"


def test_a_closed_source_is_unreachable(source_and_block) -> None:
    source, block = source_and_block
    source.close()
    with pytest.raises(TransferError) as info:
        TcpSink(torch.device("cpu")).fetch(source.source_id, source.descriptor(), block.offset,
                                           Arena(1 << 20).allocate(block.nbytes))
    assert info.value.code == "FAILED_PRECONDITION"
