"""P->D state transfer per data plane, with each plane's ceiling measured in the same run.

The sender is this process (the prefill worker's `StateSender`, staging arena on GPU 0 or the CPU); the
receiver is a child process running the decode worker's `StateReceiver` behind a gRPC server (on GPU 1 when
there are two GPUs: its CUDA_VISIBLE_DEVICES lists GPU 1 first, as the launcher does for workers). Each
transfer is timed from the send call to the decode side's reply: landed on its device, digest recomputed and
checked. Nemotron-Nano-9B-v2 state shapes (bench/system/transfer.py). Ceilings: a device-to-device copy between
the two GPUs in one process (cuda_ipc), raw loopback TCP with the same number of connections (gRPC).

  python bench/system/transfer_planes.py --device cuda --planes cuda_ipc grpc --tokens 1024 2048 8192 32768
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import torch

from hybridserve.proto import worker_pb2, worker_pb2_grpc
from hybridserve.transfer.grpc_receiver import StateAssembly, receive_stream
from hybridserve.transfer.host_copy import keep_freed_host_memory
from hybridserve.transfer.manifest import StateHeader
from hybridserve.transfer.planes import GRPC, PLANES, TransferConfig
from hybridserve.transfer.receiver import StateReceiver
from hybridserve.transfer.sender import StagedState, StateSender
from hybridserve.transfer.state_layout import StateTensorSpec, state_nbytes, state_views
from transfer import CpuMeter, nemotron_state, raw_tcp_seconds
from transfer import _serve as raw_tcp_serve

MAX_MESSAGE = 64 << 20


class _Receiver(worker_pb2_grpc.DecodeWorkerServicer):
    """The decode worker's landing path without an engine: land, check, release."""

    def __init__(self, receiver: StateReceiver) -> None:
        self.receiver = receiver
        self._assemblies: dict[str, StateAssembly] = {}

    def _specs(self, manifest) -> list[StateTensorSpec]:
        return [StateTensorSpec(t.name, getattr(torch, t.dtype), tuple(t.shape)) for t in manifest.tensors]

    def PushState(self, request_iterator, context):  # noqa: N802
        def open_assembly(manifest):
            return self._assemblies.setdefault(
                manifest.ticket, StateAssembly(manifest, self._specs(manifest), self.receiver.host_buffers))

        assembly, complete, num_bytes = receive_stream(request_iterator, open_assembly)
        if complete:
            self._assemblies.pop(assembly.manifest.ticket, None)
            self.receiver.land_host(assembly).release()
        return worker_pb2.PushStateResponse(committed=complete, bytes_received=num_bytes)

    def OfferState(self, request, context):  # noqa: N802
        self.receiver.land_offer(request, self._specs(request.manifest)).release()
        return worker_pb2.PushStateResponse(committed=True, bytes_received=request.manifest.total_bytes)

    def TransferInfo(self, request, context):  # noqa: N802
        return self.receiver.transfer_info(request.device)


def _serve_receiver(device: str, planes: list[str], staging_mb: int, port, ready) -> None:
    from hybridserve.transfer.grpc_wire import add_decode_worker_servicer

    receiver = StateReceiver(TransferConfig(planes=tuple(planes), staging_mb=staging_mb), torch.device(device))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE)])
    add_decode_worker_servicer(_Receiver(receiver), server)
    port.value = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.set()
    server.wait_for_termination()


def _staged(sender: StateSender, state, device: torch.device) -> StagedState:
    """The state copied into a block of the sender's arena, as the prefill engine stages it."""
    specs = [s for s, _ in state]
    block = sender.arena.allocate(state_nbytes(specs), timeout=60)
    views = state_views(block.data, specs)
    for spec, tensor in state:
        views[spec.name].copy_(tensor)
    ready = None
    if device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    return StagedState(specs, [views[s.name] for s in specs], block, ready)


def _send_seconds(sender: StateSender, address: str, state, device: torch.device, in_flight: int) -> float:
    """Wall time of `in_flight` transfers of the state started together (each its own block)."""
    staged = [_staged(sender, state, device) for _ in range(in_flight)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    headers = [StateHeader(uuid.uuid4().hex, "bench", "bench", 0, 0, 0) for _ in staged]
    start = time.perf_counter()
    with futures.ThreadPoolExecutor(max_workers=in_flight) as pool:
        results = list(pool.map(lambda hs: sender.send(address, hs[0], hs[1]), zip(headers, staged)))
    elapsed = time.perf_counter() - start
    if any(n != state_nbytes([s for s, _ in state]) for _, n in results):
        raise RuntimeError("the receiver took a short state")
    return elapsed


def _peer_copy_seconds(nbytes: int) -> float | None:
    """The ceiling of the cuda_ipc plane: one device-to-device copy GPU 0 -> GPU 1 in this process (with one
    GPU, both workers share it: a copy within GPU 0)."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0")

    def sync() -> None:
        for device in {src.device, dst.device}:
            torch.cuda.synchronize(device)

    dst.copy_(src)
    sync()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--planes", nargs="+", default=[GRPC], choices=PLANES)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 8192, 32768])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--grpc-streams", type=int, nargs="+", default=[2],
                        help="PushState streams per gRPC transfer; several values: one gRPC sender each")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<device>/transfer/transfer_planes.json)")
    args = parser.parse_args()
    if len(args.grpc_streams) > 1 and GRPC not in args.planes:
        parser.error("--grpc-streams takes several values only with the grpc plane")
    device = torch.device(args.device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    state_mb = max(state_nbytes([s for s, _ in nemotron_state(t, "cpu")]) for t in args.tokens) >> 20
    staging_mb = (state_mb + 16) * max(args.in_flight) + 64

    ctx = mp.get_context("spawn")
    port, ready = ctx.Value("i", 0), ctx.Event()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus >= 2:  # the receiver's own GPU first, the sender's visible after it (peer access for CUDA IPC)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in [1, 0, *range(2, gpus)])
    receiver = ctx.Process(target=_serve_receiver, args=(args.device, args.planes, staging_mb, port, ready), daemon=True)
    receiver.start()
    if saved is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = saved
    tcp_port, tcp_grpc_port, tcp_ready = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event()
    tcp = ctx.Process(target=raw_tcp_serve, args=(tcp_grpc_port, tcp_port, tcp_ready, 0), daemon=True)
    tcp.start()
    if not ready.wait(300) or not tcp_ready.wait(60):
        raise RuntimeError("the receiver processes did not start")
    address = f"127.0.0.1:{port.value}"
    send_device = torch.device("cuda:0") if device.type == "cuda" else device
    keep_freed_host_memory()
    senders = {}
    for plane in args.planes:
        for streams in args.grpc_streams if plane == GRPC else [1]:
            name = f"grpc/s{streams}" if plane == GRPC and len(args.grpc_streams) > 1 else plane
            config = TransferConfig(planes=(plane,), staging_mb=staging_mb, grpc_streams=streams)
            senders[name] = StateSender(config, send_device)

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows: list[dict] = []
    result = {"benchmark": "transfer_planes", "device": args.device, "device_name": name, "gpus": gpus,
              "cpu_count": os.cpu_count(), "ceiling_copy": "peer copy GPU0->GPU1" if gpus >= 2 else "copy within GPU 0",
              "torch": torch.__version__, "grpcio": grpc.__version__,
              "command": "python bench/system/transfer_planes.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if v is not None),
              "rows": rows}
    out = Path(args.out or f"bench/results/{'cpu' if device.type == 'cpu' else 'gpu'}/transfer/transfer_planes.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for tokens in args.tokens:
        state = nemotron_state(tokens, str(send_device))
        total = state_nbytes([s for s, _ in state])
        host = torch.cat([t.detach().cpu().contiguous().view(-1).view(torch.uint8) for _, t in state])
        payload = memoryview(host.numpy()).cast("B")
        peer = _peer_copy_seconds(total) if device.type == "cuda" else None
        raw_one = None
        for in_flight in args.in_flight:
            with futures.ThreadPoolExecutor(max_workers=in_flight) as pool:
                list(pool.map(lambda _: raw_tcp_seconds(tcp_port.value, payload), range(in_flight)))  # warm-up
                with CpuMeter(tcp.pid) as raw_cpu:
                    raw = statistics.median(
                        _timed(lambda: list(pool.map(lambda _: raw_tcp_seconds(tcp_port.value, payload),
                                                     range(in_flight))))
                        for _ in range(args.repeats))
            raw_send_cpu, raw_recv_cpu = raw_cpu.per_gb(total * in_flight * args.repeats)
            if in_flight == 1:
                raw_one = raw  # one connection's seconds per state (what earlier runs compared with)
            for plane, sender in senders.items():
                _send_seconds(sender, address, state, send_device, in_flight)  # warm-up (opens handles, agents)
                with CpuMeter(receiver.pid) as meter:
                    t = statistics.median(_send_seconds(sender, address, state, send_device, in_flight)
                                          for _ in range(args.repeats))
                moved = total * in_flight
                send_cpu, recv_cpu = meter.per_gb(moved * args.repeats)
                row = {"plane": plane, "tokens": tokens, "bytes": total, "in_flight": in_flight,
                       "seconds": t, "ms_per_state": t * 1e3 / in_flight, "gbps": moved / t / 1e9,
                       "raw_tcp_gbps": moved / raw / 1e9, "of_raw_tcp": raw / t,
                       "raw_tcp_1conn_gbps": total / raw_one / 1e9 if raw_one else None,
                       "of_raw_tcp_1conn": raw_one * in_flight / t if raw_one else None,
                       "send_cpu_s_per_gb": send_cpu, "recv_cpu_s_per_gb": recv_cpu,
                       "raw_send_cpu_s_per_gb": raw_send_cpu, "raw_recv_cpu_s_per_gb": raw_recv_cpu}
                if peer is not None:
                    row.update(peer_copy_gbps=total / peer / 1e9, of_peer_copy=peer * in_flight / t)
                rows.append(row)
                out.write_text(json.dumps(result, indent=2))  # after every row: a cut-off run keeps its rows
                copy_kind = "peer copy" if gpus >= 2 else "device copy"
                one_conn = (f"; 1 conn {row['raw_tcp_1conn_gbps']:.2f} GB/s, {row['of_raw_tcp_1conn']:.0%}"
                            if raw_one else "")
                ceiling = (f"{copy_kind} {row['peer_copy_gbps']:6.1f} GB/s ({row['of_peer_copy']:.0%}) "
                           if peer is not None else "")
                print(f"{plane:>8} {tokens:>6} tok {total / 2**20:7.1f} MiB x{in_flight}: {row['gbps']:7.2f} GB/s "
                      f"{row['ms_per_state']:8.2f} ms/state | raw TCP {row['raw_tcp_gbps']:6.2f} GB/s "
                      f"({row['of_raw_tcp']:.0%}{one_conn}) "
                      f"{ceiling}| CPU s/GB {send_cpu:.2f} / {recv_cpu:.2f} "
                      f"(raw TCP {raw_send_cpu:.2f} / {raw_recv_cpu:.2f})", flush=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    receiver.terminate()
    tcp.terminate()
    return 0


def _timed(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
