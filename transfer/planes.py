"""Data planes: which one moves a state between a given prefill and decode worker.

gRPC is always the control plane (Reserve, manifest, digest, commit / abort) and the portable data plane.
Device planes move the bytes themselves and report back over gRPC:
  cuda_ipc  same host, both workers on CUDA: the decode GPU copies straight out of the prefill GPU's staging
            arena (CUDA IPC handle, NVLink / PCIe peer copy); host memory never sees the bytes.
  nixl      NIXL over UCX (RDMA where present, TCP / shared memory otherwise): the decode worker reads the
            prefill worker's registered arena; the optional extra `hybridserve[nixl]`.
  tcp       any two hosts: the decode worker reads the offered arena range over a plain socket (no gRPC
            message copies), through pinned pieces on CUDA.
The prefill worker asks each decode worker once which planes it takes (TransferInfo) and uses the first
plane of its own preference list that both sides offer and that suits the pair.
"""

from __future__ import annotations

import functools
import importlib.util
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from hybridserve.transfer.arena import ArenaRange

GRPC, CUDA_IPC, NIXL, TCP = "grpc", "cuda_ipc", "nixl", "tcp"
PLANES = (CUDA_IPC, NIXL, TCP, GRPC)


@dataclass(frozen=True)
class TransferConfig:
    """How a worker moves states: planes in order of preference, staging memory, gRPC streaming."""

    # planes this worker offers / uses, in order of preference; "cuda_ipc" is skipped off CUDA, "grpc" is
    # always available as the fallback
    planes: tuple[str, ...] = (CUDA_IPC, GRPC)
    staging_mb: int | None = None  # the registered staging / landing arena; None: 2048 on CUDA, 256 on CPU
    grpc_streams: int = 2  # parallel PushState streams per transfer (bench/system/transfer_gpu.sh sweeps 1, 2, 4)
    grpc_chunk_bytes: int = 1 << 20  # the least CPU per GB on CPU (0.25-4 MiB tried); under gRPC's 4 MiB limit
    arena_wait_s: float = 30.0  # how long a transfer waits for arena room before it fails as RESOURCE_EXHAUSTED
    # gRPC plane: open the stream at the prompt's first prefill-chunk boundary and send the KV of finished
    # chunks while later chunks compute. Off by default: on one H200 it cut the transfer after the first token
    # by 25-70 ms but slowed the prefill as much (the send threads take the GIL from the engine loop), so TTFT
    # did not move (bench/results/h200/transfer/)
    grpc_early_send: bool = False
    # with grpc_early_send: in the forward of the prompt's last chunk, stage and send the rest of the KV once
    # the last attention layer ran and each Mamba layer's SSM state / conv window once that layer ran (instead
    # of all of it after the forward)
    grpc_layer_send: bool = True

    def __post_init__(self) -> None:
        planes = (self.planes,) if isinstance(self.planes, str) else tuple(self.planes)
        if len(planes) == 1 and "," in planes[0]:
            planes = tuple(p.strip() for p in planes[0].split(","))
        object.__setattr__(self, "planes", planes)
        unknown = [p for p in planes if p not in PLANES]
        if unknown or not planes:
            raise ValueError(f"transfer planes must be some of {list(PLANES)}, got {list(planes)}")
        if len(set(planes)) != len(planes):
            raise ValueError(f"transfer planes are listed twice: {list(planes)}")
        if NIXL in planes and not nixl_available():
            raise ValueError("transfer plane 'nixl' needs the nixl package: pip install 'hybridserve[nixl]'")
        if self.staging_mb is not None and (isinstance(self.staging_mb, bool) or self.staging_mb <= 0):
            raise ValueError(f"staging_mb must be a positive integer or None, got {self.staging_mb!r}")
        if self.grpc_streams <= 0 or self.grpc_chunk_bytes <= 0:
            raise ValueError("grpc_streams and grpc_chunk_bytes must be positive")
        if not isinstance(self.grpc_early_send, bool):
            raise ValueError(f"grpc_early_send must be true or false, got {self.grpc_early_send!r}")
        if not isinstance(self.grpc_layer_send, bool):
            raise ValueError(f"grpc_layer_send must be true or false, got {self.grpc_layer_send!r}")
        if not self.arena_wait_s >= 0:
            raise ValueError(f"arena_wait_s must be >= 0, got {self.arena_wait_s}")

    def staging_bytes(self, device: torch.device) -> int:
        mb = self.staging_mb if self.staging_mb is not None else (2048 if device.type == "cuda" else 256)
        return mb << 20

    def offered(self, device: torch.device) -> list[str]:
        """The planes this worker takes on `device`, in preference order, gRPC always last if not listed."""
        planes = [p for p in self.planes if p != CUDA_IPC or device.type == "cuda"]
        return planes if GRPC in planes else [*planes, GRPC]


class PlaneSource(Protocol):
    """The sending side of a device plane: its registered arena, described for the receiver."""

    plane: str
    source_id: str

    def descriptor(self) -> bytes: ...

    def close(self) -> None: ...


class PlaneSink(Protocol):
    """The receiving side of a device plane: reads an offered range of a source into a landing block."""

    plane: str

    def fetch(self, source_id: str, descriptor: bytes, offset: int, block: ArenaRange) -> None: ...

    def close(self) -> None: ...


def nixl_available() -> bool:
    return importlib.util.find_spec("nixl") is not None


@functools.cache
def host_id() -> str:
    """Equal for processes of one host (boot id where the kernel has one), different across hosts."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    suffix = boot.read_text().strip() if boot.is_file() else ""
    return f"{socket.gethostname()}/{suffix}"


def device_id(device: torch.device) -> str:
    """'cpu', or 'cuda:<GPU UUID>' (stable across processes whatever CUDA_VISIBLE_DEVICES says)."""
    if device.type != "cuda":
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_properties(index).uuid}"


def reachable_gpu(peer_device: str, device: torch.device) -> bool:
    """Whether this process can map memory of the peer's GPU: it is this process's GPU or a visible peer
    it has peer access to (the launcher keeps the host's GPUs visible; Ray hides them)."""
    if device.type != "cuda" or not peer_device.startswith("cuda:"):
        return False
    own = device.index if device.index is not None else torch.cuda.current_device()
    for index in range(torch.cuda.device_count()):
        if f"cuda:{torch.cuda.get_device_properties(index).uuid}" == peer_device:
            return index == own or torch.cuda.can_device_access_peer(own, index)
    return False


@dataclass(frozen=True)
class PeerInfo:
    """What a worker says about itself in TransferInfo."""

    planes: tuple[str, ...]
    host_id: str
    device: str


def choose_plane(own: PeerInfo, peer: PeerInfo) -> str:
    """The first of our planes that the peer offers too and that suits the pair (CUDA IPC: one host, both
    on CUDA); gRPC when nothing else does."""
    for plane in own.planes:
        if plane not in peer.planes:
            continue
        if plane == CUDA_IPC and not (
            own.host_id == peer.host_id and own.device.startswith("cuda") and peer.device.startswith("cuda")
        ):
            continue
        return plane
    return GRPC
