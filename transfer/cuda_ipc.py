"""The same-host GPU->GPU data plane: CUDA IPC handles of the prefill worker's staging arena.

The prefill worker shares its arena once (the handle travels in every StateOffer, a few hundred bytes); the
decode worker maps it on first sight into its own device's context with peer access enabled
(cudaIpcOpenMemHandle's lazy peer access), caches the mapping by source id, and copies the offered range into
its landing arena with one device-to-device copy (NVLink or PCIe peer traffic, never host memory).
Both processes must see both GPUs: the launcher lists a worker's own GPU first in CUDA_VISIBLE_DEVICES and the
host's other GPUs after it.
"""

from __future__ import annotations

import pickle
import threading
import uuid

import torch

from hybridserve.transfer.arena import Arena, ArenaRange
from hybridserve.transfer.manifest import TransferError
from hybridserve.transfer.planes import CUDA_IPC


class CudaIpcSource:
    """The sending side: the arena's IPC handle, taken once."""

    plane = CUDA_IPC

    def __init__(self, arena: Arena) -> None:
        if arena.device.type != "cuda":
            raise ValueError("the cuda_ipc plane needs a CUDA staging arena")
        self.source_id = f"ipc-{uuid.uuid4().hex}"
        storage = arena.buffer.untyped_storage()
        shared = storage._share_cuda_()  # (device, handle, size, offset, ref handle, ref offset, event, sync)
        base = arena.buffer.storage_offset()  # bytes: the buffer is uint8
        self._descriptor = pickle.dumps({"share": shared[1:], "base": base, "nbytes": arena.capacity})

    def descriptor(self) -> bytes:
        return self._descriptor

    def close(self) -> None:
        pass


class CudaIpcSink:
    """The receiving side: maps each source once and copies offered ranges into landing blocks."""

    plane = CUDA_IPC

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("the cuda_ipc plane needs a CUDA device")
        self.device = device
        self._mapped: dict[str, torch.Tensor] = {}  # source id -> the remote arena as a flat uint8 tensor
        self._lock = threading.Lock()

    def _open(self, source_id: str, descriptor: bytes) -> torch.Tensor:
        with self._lock:
            remote = self._mapped.get(source_id)
            if remote is None:
                try:
                    info = pickle.loads(descriptor)
                    index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                    with torch.cuda.device(index):
                        storage = torch.UntypedStorage._new_shared_cuda(index, *info["share"])
                    flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
                    remote = flat[info["base"] : info["base"] + info["nbytes"]]
                except Exception as exc:  # a stale, foreign or unmappable handle
                    raise TransferError("FAILED_PRECONDITION", f"cannot map the sender's CUDA IPC arena: {exc}") from exc
                self._mapped[source_id] = remote
            return remote

    def fetch(self, source_id: str, descriptor: bytes, offset: int, block: ArenaRange) -> None:
        """Queue the copy of the sender's bytes [offset, offset + block.nbytes) into `block` on the current
        stream (the caller's digest check waits for it)."""
        remote = self._open(source_id, descriptor)
        if offset < 0 or offset + block.nbytes > remote.numel():
            raise TransferError("INVALID_ARGUMENT", f"offer range {offset}+{block.nbytes} is outside the sender's arena")
        block.data.copy_(remote[offset : offset + block.nbytes], non_blocking=True)

    def close(self) -> None:
        with self._lock:
            self._mapped.clear()

