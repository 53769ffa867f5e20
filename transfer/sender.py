"""The prefill side of a handoff: stage the state in the registered arena, then move it over the plane the
decode worker and this one share.

Staging is a few queued device copies on the engine loop; the engine frees the request's pages and slot right
after, so its next prefill never waits on the network. Everything else (digest, the gRPC stream or the offer
to a device plane) runs on the calling handler thread, on a side CUDA stream, so many transfers are in flight
at once and neither engine loop blocks on one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import grpc
import torch

from hybridserve.proto import worker_pb2, worker_pb2_grpc
from hybridserve.proto.channels import internal_channel
from hybridserve.proto.internal_tls import InternalTlsConfig
from hybridserve.transfer.arena import Arena, ArenaFull, ArenaRange
from hybridserve.transfer.digest import device_digest
from hybridserve.transfer.grpc_sender import encode_state_streams
from hybridserve.transfer.grpc_wire import push_state_stub
from hybridserve.transfer.host_copy import keep_freed_host_memory
from hybridserve.transfer.manifest import StateHeader, build_manifest
from hybridserve.transfer.planes import (
    CUDA_IPC,
    GRPC,
    NIXL,
    TCP,
    PeerInfo,
    PlaneSource,
    TransferConfig,
    choose_plane,
    device_id,
    host_id,
)
from hybridserve.transfer.state_layout import StateTensorSpec, state_nbytes, state_views

logger = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 120.0


@dataclass
class StagedState:
    """A request's state, ready to move: in an arena block (device planes possible) or in loose tensors."""

    specs: list[StateTensorSpec]
    parts: list[torch.Tensor]  # per-tensor views in transfer order
    block: ArenaRange | None  # None: the arena had no room, the parts are copies (gRPC only)
    ready: torch.cuda.Event | None  # recorded behind the staging copies


# stage(out views or None) -> the parts; runs on the engine loop and releases the request
StageFn = Callable[[dict[str, torch.Tensor] | None], list[torch.Tensor]]
# runs a function on the engine loop thread and returns its result (EngineLoop.call)
RunOnLoop = Callable[[Callable[[], list[torch.Tensor]]], list[torch.Tensor]]


class StateSender:
    """Owns the staging arena, the device-plane sources and the gRPC channels of one prefill worker."""

    def __init__(self, config: TransferConfig, device: torch.device, internal_token: str | None = None,
                 host: str = "127.0.0.1", internal_tls: InternalTlsConfig | None = None) -> None:
        """`internal_token`: sent on calls to decode workers; `host`: the interface this worker serves on (the tcp
        plane listens there)."""
        self.config = config
        self._internal_token = internal_token  # sent on every call to a decode worker
        self._internal_tls = internal_tls  # mutual TLS on the channels to decode workers when enabled
        self.device = device
        keep_freed_host_memory()  # gRPC messages reuse freed heap blocks instead of faulting in fresh pages
        self.arena = Arena(config.staging_bytes(device), device)
        self.planes = config.offered(device)
        self.sources: dict[str, PlaneSource] = {}
        if CUDA_IPC in self.planes:
            from hybridserve.transfer.cuda_ipc import CudaIpcSource

            self.sources[CUDA_IPC] = CudaIpcSource(self.arena)
        if NIXL in self.planes:
            from hybridserve.transfer.nixl_plane import NixlSource

            self.sources[NIXL] = NixlSource(self.arena)
        if TCP in self.planes:
            from hybridserve.transfer.tcp_plane import TcpSource

            self.sources[TCP] = TcpSource(self.arena, host)
        self.info = PeerInfo(tuple(self.planes), host_id(), device_id(device))
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # address -> (what the peer offers, its PushState calls, its stub); the channels under them, to close
        self._peers: dict[str, tuple[PeerInfo, list, worker_pb2_grpc.DecodeWorkerStub]] = {}
        self._channels: dict[str, list[grpc.Channel]] = {}
        self._closed = False
        self._lock = threading.Lock()

    # ---- staging (the engine loop calls stage_fn) ----------------------------------------------
    def stage(self, specs: list[StateTensorSpec], run_on_loop: RunOnLoop, stage_fn: StageFn) -> StagedState:
        """Reserve an arena block (or fall back to loose copies), have the loop copy the state in."""
        block = self.reserve_block(specs, self.config.arena_wait_s)
        views = state_views(block.data, specs) if block is not None else None
        ready: list[torch.cuda.Event | None] = []

        def stage_and_mark() -> list[torch.Tensor]:
            parts = stage_fn(views)
            ready.append(self.mark_staged())
            return parts

        try:
            parts = run_on_loop(stage_and_mark)
        except BaseException:
            self.release_block(block)
            raise
        return StagedState(specs, parts, block, ready[0])

    def reserve_block(self, specs: list[StateTensorSpec], timeout: float) -> ArenaRange | None:
        """An arena block for a state of `specs` (waiting up to `timeout` s); None when there is no room."""
        nbytes = state_nbytes(specs)
        if not self.arena.fits(nbytes):
            return None
        try:
            return self.arena.allocate(nbytes, timeout=timeout)
        except ArenaFull:
            if timeout > 0:
                logger.warning("staging arena full for %d s: this state goes as loose copies over gRPC", timeout)
            return None

    def release_block(self, block: ArenaRange | None) -> None:
        """Give back a block whose state was never staged (the request failed before its export)."""
        if block is not None:
            self.arena.free(block)

    def mark_staged(self) -> torch.cuda.Event | None:
        """Call on the engine loop thread right after queuing the staging copies: an event that follows them
        and nothing else (recorded later from another thread, it would also wait for the loop's next step)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the loop's stream is the default stream
        return event

    # ---- moving ---------------------------------------------------------------------------------
    def peer(self, address: str) -> tuple[PeerInfo, list, worker_pb2_grpc.DecodeWorkerStub]:
        """TransferInfo of a decode worker (asked once per incarnation: see `forget`), its PushState calls and its
        stub."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the state sender is closed (the prefill worker stopped)")
            if address not in self._peers:
                tls, token = self._internal_tls, self._internal_token
                channels = [internal_channel(address, token, tls=tls)]  # TransferInfo and OfferState
                channels += [internal_channel(address, token, ("grpc.channel_id", i), tls=tls)  # own conns
                             for i in range(self.config.grpc_streams)]
                try:
                    stub = worker_pb2_grpc.DecodeWorkerStub(channels[0])
                    reply = stub.TransferInfo(worker_pb2.TransferInfoRequest(device=self.info.device), timeout=30)
                except BaseException:
                    for channel in channels:
                        channel.close()
                    raise
                info = PeerInfo(tuple(reply.planes), reply.host_id, reply.device)
                self._peers[address] = (info, [push_state_stub(c) for c in channels[1:]], stub)
                self._channels[address] = channels
                logger.info("state transfers to %s use %s (peer offers %s)", address,
                            choose_plane(self.info, info), list(info.planes))
            return self._peers[address]

    def forget(self, address: str, error: BaseException) -> None:
        """After a transfer to `address` failed: when the peer was unreachable, drop what was learned of it, so the
        next transfer asks again (a decode worker restarted on the same address may offer other planes or sit on
        another device). Its channels are not closed here: another request's transfer may still be on them; they
        close when the last one lets go."""
        if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE:
            with self._lock:
                if self._peers.pop(address, None) is not None:
                    self._channels.pop(address, None)
                    logger.info("decode worker %s unreachable: its transfer info is asked again next time", address)

    def send(self, address: str, header: StateHeader, staged: StagedState) -> tuple[str, int]:
        """Move a staged state to the decode worker at `address`; returns (plane, bytes). Frees the block."""
        try:
            return self._send(address, header, staged)
        except BaseException as exc:
            self.forget(address, exc)
            raise
        finally:
            self._free(staged)

    def _send(self, address: str, header: StateHeader, staged: StagedState) -> tuple[str, int]:
        info, calls, stub = self.peer(address)
        plane = choose_plane(self.info, info) if staged.block is not None else GRPC
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with stream_ctx:
            if staged.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(staged.ready)
            # host bytes over gRPC are covered end to end by the chunks' crc32c: the device digest is
            # for bytes that live on a GPU or skip the stream (a host-side reduction costs ~0.6 s / 141 MiB)
            needs_digest = plane != GRPC or self.device.type == "cuda"
            digest = device_digest(staged.block.data) if staged.block is not None and needs_digest else 0
            header = StateHeader(**{**header.__dict__, "device_digest": digest})
            if plane == GRPC or staged.block is None:
                return GRPC, self._push(calls, header, staged.specs, staged.parts)
            source = self.sources[plane]
            offer = worker_pb2.StateOffer(
                manifest=build_manifest(header, staged.specs), plane=plane, source_id=source.source_id,
                source_descriptor=source.descriptor(), offset=staged.block.offset,
            )
            exposed = getattr(source, "exposed", None)  # a plane that serves reads only of offered ranges
            with exposed(staged.block.offset, staged.block.nbytes) if exposed else nullcontext():
                reply = stub.OfferState(offer, timeout=PUSH_TIMEOUT_S)
            if not reply.committed:
                raise RuntimeError("the decode worker did not commit the state")
            return plane, reply.bytes_received

    def _free(self, staged: StagedState) -> None:
        """Give the staged state's arena block back once the sender's stream is past its reads."""
        if staged.block is not None:
            after = None
            if self._stream is not None:
                after = torch.cuda.Event()
                after.record(self._stream)
            self.arena.free(staged.block, after=after)

    def _push(self, calls: list, header: StateHeader, specs: list[StateTensorSpec], parts: Iterable) -> int:
        """Send a state over `calls` (one stream each)."""
        streams = encode_state_streams(header, specs, parts, self.config.grpc_chunk_bytes,
                                       pre_encoded=True, num_streams=len(calls))
        if len(calls) == 1:
            replies = [calls[0](streams[0], timeout=PUSH_TIMEOUT_S)]
        else:
            pending = [call.future(stream, timeout=PUSH_TIMEOUT_S) for call, stream in zip(calls, streams)]
            replies, errors = [], []
            for future in pending:
                try:
                    replies.append(future.result())
                except grpc.FutureCancelledError:  # stopped here after another stream failed
                    continue
                except grpc.RpcError as exc:
                    errors.append(exc)
                    for other in pending:  # one failed: stop the others
                        other.cancel()
            if errors:  # the stream that found the fault, not one that saw the reservation go after it
                raise min(errors, key=_consequential)
        if sum(r.committed for r in replies) != 1:
            raise RuntimeError("the decode worker did not commit the state")
        return sum(r.bytes_received for r in replies)

    def close(self) -> None:
        """Close the device-plane sources and every channel to decode workers (a channel left open keeps
        reconnecting to a peer that may be gone)."""
        with self._lock:
            self._closed = True
            channels = [c for chans in self._channels.values() for c in chans]
            self._peers.clear()
            self._channels.clear()
        for channel in channels:
            channel.close()
        for source in self.sources.values():
            source.close()



def _consequential(error: grpc.RpcError) -> bool:
    """True for a stream's failure that only follows another's: cancelled, or the reservation already gone."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else ""
    return code == grpc.StatusCode.CANCELLED or "unknown or expired ticket" in (details or "")
