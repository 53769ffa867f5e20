"""The staging arena's allocator, the device digest, the transfer config and the choice of data plane."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.transfer.arena import ALIGN, Arena, ArenaFull
from hybridserve.transfer.digest import device_digest
from hybridserve.transfer.planes import CUDA_IPC, GRPC, NIXL, PeerInfo, TransferConfig, choose_plane


def test_arena_hands_out_aligned_disjoint_ranges_and_merges_freed_ones() -> None:
    arena = Arena(4 * ALIGN)
    a, b = arena.allocate(10), arena.allocate(ALIGN + 1)
    assert (a.offset, b.offset) == (0, ALIGN) and a.data.numel() == 10
    with pytest.raises(ArenaFull):
        arena.allocate(2 * ALIGN)  # one range of ALIGN is left
    arena.free(a)
    arena.free(b)
    assert arena.free_bytes() == arena.capacity
    assert arena.allocate(4 * ALIGN).offset == 0  # the holes merged back into one
    with pytest.raises(ArenaFull, match="never fit"):
        arena.allocate(5 * ALIGN)


def test_allocate_waits_for_a_range_to_come_free() -> None:
    arena = Arena(ALIGN)
    block = arena.allocate(ALIGN)
    threading.Timer(0.05, arena.free, args=(block,)).start()
    start = time.monotonic()
    assert arena.allocate(ALIGN, timeout=10).offset == 0
    assert time.monotonic() - start < 10


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=3 * ALIGN), min_size=1, max_size=12), st.randoms())
def test_ranges_never_overlap_and_all_bytes_come_back(sizes: list[int], rng) -> None:  # noqa: ANN001
    arena = Arena(16 * ALIGN)
    held = []
    for size in sizes:
        try:
            held.append(arena.allocate(size))
        except ArenaFull:
            arena.free(held.pop(rng.randrange(len(held))))
        spans = sorted((r.offset, r.offset + r.nbytes) for r in held)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
        assert all(r.offset % ALIGN == 0 for r in held)
    for block in held:
        arena.free(block)
    assert arena.free_bytes() == arena.capacity


@pytest.mark.parametrize("nbytes", [1, 3, 4, 4096 * 4, 4096 * 4 + 12, 4096 * 4 * 3 + 2])
def test_device_digest_sees_flips_truncation_and_reordering(nbytes: int) -> None:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    digest = device_digest(data)
    assert device_digest(data.clone()) == digest
    flipped = data.clone()
    flipped[nbytes // 2] ^= 0x01
    assert device_digest(flipped) != digest
    if nbytes > 1:
        assert device_digest(data[:-1]) != digest
    if nbytes >= 8 and not torch.equal(data[:4], data[4:8]):
        swapped = data.clone()
        swapped[:4], swapped[4:8] = data[4:8], data[:4]
        assert device_digest(swapped) != digest


def test_transfer_config_validates_planes() -> None:
    assert TransferConfig(planes="cuda_ipc, grpc").planes == (CUDA_IPC, GRPC)
    with pytest.raises(ValueError, match="some of"):
        TransferConfig(planes=("rdma",))
    with pytest.raises(ValueError, match="listed twice"):
        TransferConfig(planes=(GRPC, GRPC))
    with pytest.raises(ValueError, match="staging_mb"):
        TransferConfig(staging_mb=0)
    cpu = TransferConfig(planes=(CUDA_IPC,)).offered(torch.device("cpu"))
    assert cpu == [GRPC]  # CUDA IPC dropped off CUDA, gRPC always there


def _peer(planes: tuple[str, ...], host: str = "h", device: str = "cuda:GPU-1") -> PeerInfo:
    return PeerInfo(planes, host, device)


@pytest.mark.parametrize("own, peer, want", [
    (_peer((CUDA_IPC, GRPC), device="cuda:GPU-0"), _peer((CUDA_IPC, GRPC)), CUDA_IPC),
    (_peer((CUDA_IPC, GRPC), host="a"), _peer((CUDA_IPC, GRPC), host="b"), GRPC),  # other host: no IPC
    (_peer((CUDA_IPC, NIXL, GRPC), host="a"), _peer((CUDA_IPC, NIXL, GRPC), host="b"), NIXL),
    (_peer((CUDA_IPC, GRPC), device="cpu"), _peer((CUDA_IPC, GRPC)), GRPC),  # a CPU sender
    (_peer((CUDA_IPC, GRPC)), _peer((GRPC,)), GRPC),  # the decode side does not offer it
    (_peer((NIXL,)), _peer((GRPC,)), GRPC),  # nothing shared: gRPC
])
def test_the_first_plane_both_offer_that_suits_the_pair_is_chosen(own: PeerInfo, peer: PeerInfo, want: str) -> None:
    assert choose_plane(own, peer) == want


@pytest.mark.parametrize("nbytes", [17, 4 * 4096 + 5, 3 * 4 * 4096])
def test_cpu_digest_equals_the_device_formula(nbytes: int) -> None:
    """The CPU path sums with numpy; the digest must equal torch's sums (what a GPU computes) bit for bit."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    whole = nbytes - nbytes % 4
    words = data[:whole].view(torch.int32)
    full = words.numel() // 4096
    grid = words[: full * 4096].view(full, 4096)
    rest = torch.zeros(4096, dtype=torch.int64)
    rest[: words.numel() - full * 4096] = words[full * 4096 :]
    rows = grid.sum(dim=1, dtype=torch.int64)
    cols = grid.sum(dim=0, dtype=torch.int64)
    if words.numel() > full * 4096:
        rows, cols = torch.cat([rows, rest.sum().view(1)]), cols + rest
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64)
    col_weights = torch.arange(1, 4097, dtype=torch.int64) * 0x9E3779B1
    total, by_row, by_col = (int(v) for v in (rows.sum(), (rows * weights).sum(), (cols * col_weights).sum()))
    tail = int.from_bytes(bytes(data[whole:].tolist()), "little") if whole != nbytes else 0
    want = (total * 0x100000001B3) ^ (by_row * 0xC2B2AE3D27D4EB4F) ^ by_col ^ (tail << 7) ^ nbytes
    assert device_digest(data) == want & 0xFFFFFFFFFFFFFFFF
