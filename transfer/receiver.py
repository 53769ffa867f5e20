"""The decode side of a handoff: land a state on the engine's device and check it, before the engine loop
commits it in one short step of device-local copies.

Landing runs on the handler thread and a side CUDA stream: a device plane copies the offered range straight
into the landing arena (CUDA IPC peer copy, NIXL read); a gRPC-received host buffer is copied up from pinned
memory. The device digest is then recomputed on the landed bytes and compared with the sender's; only a state
that passed every check reaches the engine.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from hybridserve.proto import worker_pb2
from hybridserve.transfer.arena import Arena, ArenaFull, ArenaRange
from hybridserve.transfer.digest import device_digest
from hybridserve.transfer.grpc_receiver import ReceiveBuffers, StateAssembly
from hybridserve.transfer.host_copy import keep_freed_host_memory
from hybridserve.transfer.manifest import TransferError
from hybridserve.transfer.planes import (
    CUDA_IPC,
    NIXL,
    TCP,
    PeerInfo,
    PlaneSink,
    TransferConfig,
    device_id,
    host_id,
    reachable_gpu,
)
from hybridserve.transfer.state_layout import StateTensorSpec, state_views

logger = logging.getLogger(__name__)


@dataclass
class LandedState:
    """Checked tensors on the engine's device; `release()` once the commit's copies are queued."""

    manifest: worker_pb2.StateManifest
    tensors: dict[str, torch.Tensor]
    num_bytes: int
    _receiver: StateReceiver
    _block: ArenaRange | None
    _host: StateAssembly | None

    def release(self) -> None:
        self._receiver._release(self)


class StateReceiver:
    """Owns the landing arena, the device-plane sinks and the gRPC receive buffers of one decode worker."""

    def __init__(self, config: TransferConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        keep_freed_host_memory()  # gRPC messages reuse freed heap blocks instead of faulting in fresh pages
        self.planes = config.offered(device)
        self.host_buffers = ReceiveBuffers(pin_memory=device.type == "cuda")
        # CPU engines commit straight from the host buffers; the arena lands device planes (and, on CUDA,
        # gRPC states copied up from pinned memory)
        self.arena = Arena(config.staging_bytes(device), device)
        self.sinks: dict[str, PlaneSink] = {}
        if CUDA_IPC in self.planes:
            from hybridserve.transfer.cuda_ipc import CudaIpcSink

            self.sinks[CUDA_IPC] = CudaIpcSink(device)
        if NIXL in self.planes:
            from hybridserve.transfer.nixl_plane import NixlSink

            self.sinks[NIXL] = NixlSink(self.arena)
        if TCP in self.planes:
            from hybridserve.transfer.tcp_plane import TcpSink

            self.sinks[TCP] = TcpSink(device)
        self.info = PeerInfo(tuple(self.planes), host_id(), device_id(device))
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def transfer_info(self, peer_device: str) -> worker_pb2.TransferInfoResponse:
        """What this worker offers a sender on `peer_device` (CUDA IPC only if that GPU is reachable here)."""
        planes = [p for p in self.info.planes if p != CUDA_IPC or reachable_gpu(peer_device, self.device)]
        return worker_pb2.TransferInfoResponse(planes=planes, host_id=self.info.host_id, device=self.info.device)

    def _stream_ctx(self):  # noqa: ANN202
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def _allocate(self, nbytes: int) -> ArenaRange:
        try:
            return self.arena.allocate(nbytes, timeout=self.config.arena_wait_s)
        except ArenaFull as exc:
            raise TransferError("RESOURCE_EXHAUSTED", f"no room to land the state: {exc}") from exc

    def land_offer(self, offer: worker_pb2.StateOffer, specs: list[StateTensorSpec]) -> LandedState:
        """Read an offered state through its device plane into the landing arena and check its digest."""
        sink = self.sinks.get(offer.plane)
        if sink is None:
            raise TransferError("INVALID_ARGUMENT", f"this worker takes no {offer.plane!r} offers, only {self.planes}")
        manifest = offer.manifest
        with self._stream_ctx():
            block = self._allocate(manifest.total_bytes)
            try:
                sink.fetch(offer.source_id, offer.source_descriptor, offer.offset, block)
                _check_digest(manifest, block.data)
            except BaseException:
                self.arena.free(block, after=self._event())
                raise
        return LandedState(manifest, state_views(block.data, specs), manifest.total_bytes, self, block, None)

    def land_host(self, assembly: StateAssembly) -> LandedState:
        """A state received over gRPC into host memory: checked, and on CUDA copied up to the landing arena."""
        manifest = assembly.manifest
        if self.device.type != "cuda":
            _check_digest(manifest, assembly.buffer)
            return LandedState(manifest, state_views(assembly.buffer, assembly.specs), manifest.total_bytes,
                               self, None, assembly)
        with self._stream_ctx():
            block = self._allocate(manifest.total_bytes)
            try:
                block.data.copy_(assembly.buffer, non_blocking=True)  # pinned -> device
                _check_digest(manifest, block.data)  # syncs the side stream: the host buffer is free after
            except BaseException:
                self.arena.free(block, after=self._event())
                raise
            finally:
                assembly.release()
        return LandedState(manifest, state_views(block.data, assembly.specs), manifest.total_bytes, self, block, None)

    def _event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _release(self, landed: LandedState) -> None:
        """Called on the engine loop right after the commit queued its copies out of the landed tensors."""
        if landed._block is not None:
            self.arena.free(landed._block, after=self._event())
            landed._block = None
        if landed._host is not None:
            landed._host.release()
            landed._host = None

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()


def _check_digest(manifest: worker_pb2.StateManifest, data: torch.Tensor) -> None:
    if manifest.device_digest and device_digest(data[: manifest.total_bytes]) != manifest.device_digest:
        raise TransferError("DATA_LOSS", "the landed state's device digest does not match the sender's")
