"""P->D state transfer over gRPC vs raw loopback TCP, measured in the same run.

Nemotron-Nano-9B-v2 shapes: 27 Mamba layers (conv window bf16 + SSM state fp32, ~137 MiB) plus 4 attention
layers of KV (16 KiB per token, bf16) and the last hidden state. Receivers run in a separate process, so
sender and receiver do not share a GIL. Prints a table; writes JSON to bench/results/<device>/transfer/transfer.json.

  python bench/system/transfer.py [--device cuda] [--tokens 1024 8192 32768] [--chunk-mib 1 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import torch

from hybridserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from hybridserve.transfer.grpc_receiver import ReceiveBuffers, StateAssembly, receive_stream
from hybridserve.transfer.grpc_sender import encode_state_streams
from hybridserve.transfer.grpc_wire import add_decode_worker_servicer, push_state_stub
from hybridserve.transfer.host_copy import keep_freed_host_memory
from hybridserve.transfer.manifest import StateHeader
from hybridserve.transfer.state_layout import StateTensorSpec

MAMBA_LAYERS, CONV_DIM, CONV_WIDTH = 27, 128 * 80 + 2 * 8 * 128, 3
HEADS, HEAD_DIM, STATE = 128, 80, 128
ATTN_LAYERS, KV_HEADS, KV_DIM, HIDDEN = 4, 8, 128, 4480
MAX_MESSAGE = 64 << 20


def channel_options(window_mib: float) -> list[tuple[str, int]]:
    """Message limits raised; with window_mib > 0 also the HTTP/2 stream window (lookahead) and frame size."""
    options = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
    if window_mib > 0:
        options += [("grpc.http2.lookahead_bytes", int(window_mib * (1 << 20))),
                    ("grpc.http2.max_frame_size", (1 << 24) - 1)]
    return options


def nemotron_state(num_tokens: int, device: str) -> list[tuple[StateTensorSpec, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    kv = (ATTN_LAYERS, num_tokens, KV_HEADS, KV_DIM)
    tensors = {
        "kv.k": rand(*kv, dtype=torch.bfloat16),
        "kv.v": rand(*kv, dtype=torch.bfloat16),
        "conv": rand(MAMBA_LAYERS, CONV_DIM, CONV_WIDTH, dtype=torch.bfloat16),
        "ssm": rand(MAMBA_LAYERS, HEADS, HEAD_DIM, STATE, dtype=torch.float32),
        "hidden": rand(HIDDEN, dtype=torch.bfloat16),
    }
    return [(StateTensorSpec(n, t.dtype, tuple(t.shape)), t) for n, t in tensors.items()]


class _Sink(worker_pb2_grpc.DecodeWorkerServicer):
    """Receives and fully checks a state (the decode worker's receive path, striped streams included),
    then drops it."""

    def __init__(self) -> None:
        self._assemblies: dict[str, StateAssembly] = {}
        self._buffers = ReceiveBuffers()
        self._lock = threading.Lock()

    def PushState(self, request_iterator, context):  # noqa: N802 - gRPC method name
        def open_assembly(manifest):
            specs = [StateTensorSpec(t.name, getattr(torch, t.dtype), tuple(t.shape)) for t in manifest.tensors]
            with self._lock:
                if manifest.ticket not in self._assemblies:
                    self._assemblies[manifest.ticket] = StateAssembly(manifest, specs, self._buffers)
                return self._assemblies[manifest.ticket]

        assembly, complete, num_bytes = receive_stream(request_iterator, open_assembly)
        if complete:
            assembly.result()
            assembly.release()
            with self._lock:
                self._assemblies.pop(assembly.manifest.ticket, None)
        return worker_pb2.PushStateResponse(committed=complete, bytes_received=num_bytes)

    def Health(self, request, context):  # noqa: N802
        return common_pb2.HealthResponse(status="ok", role="bench")


def _serve(grpc_port: mp.Value, tcp_port: mp.Value, ready: mp.Event, window_mib: float) -> None:
    keep_freed_host_memory()  # as the workers do
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=channel_options(window_mib))
    add_decode_worker_servicer(_Sink(), server)
    grpc_port.value = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    tcp_port.value = listener.getsockname()[1]
    ready.set()
    while True:  # each connection on its own thread: N connections in flight are N concurrent receivers
        conn, _ = listener.accept()
        threading.Thread(target=_raw_receive, args=(conn,), daemon=True).start()


_RAW_BUFFERS: list[bytearray] = []  # reused receive buffers (as the gRPC receiver reuses its own)
_RAW_LOCK = threading.Lock()


def _raw_receive(conn: socket.socket) -> None:
    with conn:
        expected = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
        with _RAW_LOCK:
            fits = [i for i, b in enumerate(_RAW_BUFFERS) if len(b) >= expected]
            buffer = _RAW_BUFFERS.pop(fits[0]) if fits else bytearray(expected)
        view = memoryview(buffer)
        got = 0
        try:
            while got < expected:  # the payload lands in one buffer, as a state does
                n = conn.recv_into(view[got:], expected - got)
                if n == 0:
                    break
                got += n
            conn.sendall(got.to_bytes(8, "little"))
        finally:
            with _RAW_LOCK:
                _RAW_BUFFERS.append(buffer)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc): what a transfer costs the
    machine, robust where wall time is not (a shared, small CPU)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds per GB moved, of the sending process (this one) and the receiving one."""

    def __init__(self, receiver_pid: int) -> None:
        self.pids = (os.getpid(), receiver_pid)

    def __enter__(self) -> CpuMeter:
        self.start = [cpu_seconds(p) for p in self.pids]
        return self

    def __exit__(self, *exc: object) -> None:
        self.used = [cpu_seconds(p) - s for p, s in zip(self.pids, self.start)]

    def per_gb(self, moved_bytes: int) -> tuple[float, float]:
        return self.used[0] / (moved_bytes / 1e9), self.used[1] / (moved_bytes / 1e9)


def raw_tcp_seconds(port: int, payload: memoryview) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(len(payload).to_bytes(8, "little"))
        conn.sendall(payload)
        if int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little") != len(payload):
            raise RuntimeError("raw TCP receiver got a short payload")
    return time.perf_counter() - start


def grpc_seconds(calls, state, chunk_bytes: int) -> float:
    """One state over len(calls) parallel striped streams, as the prefill worker sends it."""
    specs = [s for s, _ in state]
    parts = [layer for _, t in state for layer in (t if t.dim() > 1 else [t])]
    header = StateHeader(uuid.uuid4().hex, "bench", "bench", 0, 0, 0)
    if parts[0].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    streams = encode_state_streams(header, specs, parts, chunk_bytes, pre_encoded=True, num_streams=len(calls))
    replies = [f.result() for f in [call.future(stream) for call, stream in zip(calls, streams)]]
    elapsed = time.perf_counter() - start
    if sum(r.bytes_received for r in replies) != sum(s.nbytes for s in specs) or sum(r.committed for r in replies) != 1:
        raise RuntimeError("gRPC receiver got a short payload")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--chunk-mib", type=float, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4], help="parallel PushState streams")
    parser.add_argument("--window-mib", type=float, default=0, help="HTTP/2 stream window; 0 = gRPC default")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<device>/transfer/transfer.json)")
    args = parser.parse_args()

    keep_freed_host_memory()
    ctx = mp.get_context("spawn")
    grpc_port, tcp_port, ready = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event()
    server = ctx.Process(target=_serve, args=(grpc_port, tcp_port, ready, args.window_mib), daemon=True)
    server.start()
    ready.wait(60)
    address = f"127.0.0.1:{grpc_port.value}"
    worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(address)).Health(common_pb2.HealthRequest(), timeout=30)
    calls = [
        push_state_stub(grpc.insecure_channel(address, options=[*channel_options(args.window_mib), ("grpc.channel_id", i)]))
        for i in range(max(args.streams))
    ]

    rows = []
    for tokens in args.tokens:
        state = nemotron_state(tokens, args.device)
        total = sum(s.nbytes for s, _ in state)
        host = torch.cat([t.detach().cpu().contiguous().view(-1).view(torch.uint8) for _, t in state])
        payload = memoryview(host.numpy()).cast("B")
        raw_tcp_seconds(tcp_port.value, payload)  # warm-up
        with CpuMeter(server.pid) as raw_cpu:
            raw = statistics.median(raw_tcp_seconds(tcp_port.value, payload) for _ in range(args.repeats))
        raw_send_cpu, raw_recv_cpu = raw_cpu.per_gb(total * args.repeats)
        for chunk_mib, streams in [(c, n) for c in args.chunk_mib for n in args.streams]:
            chunk = int(chunk_mib * (1 << 20))
            grpc_seconds(calls[:streams], state, chunk)  # warm-up
            with CpuMeter(server.pid) as meter:
                times = [grpc_seconds(calls[:streams], state, chunk) for _ in range(args.repeats)]
            t = statistics.median(times)
            send_cpu, recv_cpu = meter.per_gb(total * args.repeats)
            rows.append({
                "tokens": tokens, "bytes": total, "chunk_mib": chunk_mib, "streams": streams,
                "grpc_s": t, "grpc_gbps": total / t / 1e9, "raw_tcp_s": raw, "raw_tcp_gbps": total / raw / 1e9,
                "ratio": raw / t, "send_cpu_s_per_gb": send_cpu, "recv_cpu_s_per_gb": recv_cpu,
                "raw_send_cpu_s_per_gb": raw_send_cpu, "raw_recv_cpu_s_per_gb": raw_recv_cpu,
            })
            print(f"{tokens:>6} tok {total / 2**20:8.1f} MiB chunk {chunk_mib:>4} MiB x{streams}: "
                  f"gRPC {total / t / 1e9:6.2f} GB/s "
                  f"({t * 1e3:7.1f} ms)  raw TCP {total / raw / 1e9:6.2f} GB/s  ratio {raw / t:5.2f} | CPU s/GB send "
                  f"{send_cpu:.2f} recv {recv_cpu:.2f} (raw TCP {raw_send_cpu:.2f} / {raw_recv_cpu:.2f})", flush=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = {
        "benchmark": "transfer", "device": args.device, "device_name": device_name,
        "torch": torch.__version__, "grpcio": grpc.__version__, "cpu_count": mp.cpu_count(),
        "command": "python bench/system/transfer.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "rows": rows,
    }
    out = Path(args.out or f"bench/results/{'cpu' if args.device == 'cpu' else 'gpu'}/transfer/transfer.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    server.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
