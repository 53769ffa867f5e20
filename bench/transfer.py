"""P->D state transfer over gRPC vs raw loopback TCP, measured in the same run.

Nemotron-Nano-9B-v2 shapes: 27 Mamba layers (conv window bf16 + SSM state fp32, ~137 MiB) plus 4 attention
layers of KV (16 KiB per token, bf16) and the last hidden state. Receivers run in a separate process, so
sender and receiver do not share a GIL. Prints a table; writes JSON to bench/results/<device>/transfer.json.

  python bench/transfer.py [--device cuda] [--tokens 1024 8192 32768] [--chunk-mib 1 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import socket
import statistics
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

from hybridserve.decode_worker.state_receiver import receive_state
from hybridserve.prefill_worker.state_sender import StateHeader, encode_state
from hybridserve.proto import common_pb2, worker_pb2, worker_pb2_grpc
from hybridserve.statepool.request_state import StateTensorSpec

MAMBA_LAYERS, CONV_DIM, CONV_WIDTH = 27, 128 * 80 + 2 * 8 * 128, 3
HEADS, HEAD_DIM, STATE = 128, 80, 128
ATTN_LAYERS, KV_HEADS, KV_DIM, HIDDEN = 4, 8, 128, 4480
MAX_MESSAGE = 64 << 20


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
    """Receives and fully checks a stream (the decode worker's receive path), then drops it."""

    def PushState(self, request_iterator, context):  # noqa: N802 - gRPC method name
        def specs_of(manifest):
            return [
                StateTensorSpec(t.name, getattr(torch, t.dtype), tuple(t.shape)) for t in manifest.tensors
            ]

        received = receive_state(request_iterator, specs_of)
        return worker_pb2.PushStateResponse(committed=True, bytes_received=received.num_bytes)

    def Health(self, request, context):  # noqa: N802
        return common_pb2.HealthResponse(status="ok", role="bench")


def _serve(grpc_port: mp.Value, tcp_port: mp.Value, ready: mp.Event) -> None:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Sink(), server)
    grpc_port.value = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    tcp_port.value = listener.getsockname()[1]
    ready.set()
    buffer = bytearray(64 << 20)
    view = memoryview(buffer)
    while True:
        conn, _ = listener.accept()
        with conn:
            expected = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
            got = 0
            while got < expected:
                n = conn.recv_into(view, min(len(buffer), expected - got))
                if n == 0:
                    break
                got += n
            conn.sendall(got.to_bytes(8, "little"))


def raw_tcp_seconds(port: int, payload: memoryview) -> float:
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(len(payload).to_bytes(8, "little"))
        conn.sendall(payload)
        if int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little") != len(payload):
            raise RuntimeError("raw TCP receiver got a short payload")
    return time.perf_counter() - start


def grpc_seconds(stub, state, chunk_bytes: int) -> float:
    specs = [s for s, _ in state]
    parts = [layer for _, t in state for layer in (t if t.dim() > 1 else [t])]
    header = StateHeader("bench", "bench", "bench", 0, 0, 0)
    if parts[0].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    reply = stub.PushState(encode_state(header, specs, parts, chunk_bytes))
    elapsed = time.perf_counter() - start
    if reply.bytes_received != sum(s.nbytes for s in specs):
        raise RuntimeError("gRPC receiver got a short payload")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--chunk-mib", type=float, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<device>/transfer.json)")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    grpc_port, tcp_port, ready = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event()
    server = ctx.Process(target=_serve, args=(grpc_port, tcp_port, ready), daemon=True)
    server.start()
    ready.wait(60)
    options = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port.value}", options=options)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    stub.Health(common_pb2.HealthRequest(), timeout=30)

    rows = []
    for tokens in args.tokens:
        state = nemotron_state(tokens, args.device)
        total = sum(s.nbytes for s, _ in state)
        host = torch.cat([t.detach().cpu().contiguous().view(-1).view(torch.uint8) for _, t in state])
        payload = memoryview(host.numpy()).cast("B")
        raw_tcp_seconds(tcp_port.value, payload)  # warm-up
        raw = statistics.median(raw_tcp_seconds(tcp_port.value, payload) for _ in range(args.repeats))
        for chunk_mib in args.chunk_mib:
            chunk = int(chunk_mib * (1 << 20))
            grpc_seconds(stub, state, chunk)  # warm-up
            times = [grpc_seconds(stub, state, chunk) for _ in range(args.repeats)]
            t = statistics.median(times)
            rows.append({
                "tokens": tokens, "bytes": total, "chunk_mib": chunk_mib,
                "grpc_s": t, "grpc_gbps": total / t / 1e9, "raw_tcp_s": raw, "raw_tcp_gbps": total / raw / 1e9,
                "ratio": raw / t,
            })
            print(f"{tokens:>6} tok {total / 2**20:8.1f} MiB chunk {chunk_mib:>4} MiB: gRPC {total / t / 1e9:6.2f} GB/s "
                  f"({t * 1e3:7.1f} ms)  raw TCP {total / raw / 1e9:6.2f} GB/s  ratio {raw / t:5.2f}", flush=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = {
        "benchmark": "transfer", "device": args.device, "device_name": device_name,
        "torch": torch.__version__, "grpcio": grpc.__version__, "cpu_count": mp.cpu_count(),
        "command": "python bench/transfer.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "rows": rows,
    }
    out = Path(args.out or f"bench/results/{'cpu' if args.device == 'cpu' else 'gpu'}/transfer.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    server.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
