"""What one gRPC relay hop costs, by relay kind: the floor under the router's added latency (issue 20, < 1 ms).

A stub decode worker (bench/router_overhead.py's, own process) is called directly, and through three bare
relays that forward GenerateLocal events as Router/Generate (no router logic): grpc.aio (bench/router_floor.py,
the router's stack), grpc.aio reaching the stub over a unix socket, and sync grpc with a thread pool. Sequential
calls (64-token prompt, 4 tokens), blocks of 100 per kind in alternating order; p50 over all blocks.

    python bench/router_relay_variants.py --rounds 10 --out bench/results/cpu/router_relay_variants.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import threading
import time
import uuid
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import router_floor
import router_stub

from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from hybridserve.proto.channels import message_options


def _serve_stub(socket_path: str, queue: Any) -> None:
    """Child process: the stub worker on a TCP port and a unix socket."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(router_stub.StubDecode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    queue.put((f"127.0.0.1:{port}", f"unix:{socket_path}"))
    threading.Event().wait()


def _serve_sync_relay(stub_address: str, queue: Any) -> None:
    """Child process: the relay on sync grpc (a thread per call from a pool)."""
    stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(stub_address, options=message_options()))

    class Proxy(router_pb2_grpc.RouterServicer):
        def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
            call = stub.GenerateLocal(worker_pb2.GenerateLocalRequest(
                request_id=uuid.uuid4().hex, prompt_token_ids=request.token_ids.ids, sampling=request.sampling),
                timeout=3600)
            for event in call:
                yield router_pb2.GenerateResponse(event=event)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=message_options())
    router_pb2_grpc.add_RouterServicer_to_server(Proxy(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    queue.put((f"127.0.0.1:{port}", None))
    threading.Event().wait()


def measure(rounds: int, block: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    socket_path = os.path.join(tempfile.mkdtemp(), "stub.sock")
    procs = [ctx.Process(target=_serve_stub, args=(socket_path, queue), daemon=True)]
    procs[0].start()
    stub_tcp, stub_unix = queue.get(timeout=60)
    relays = {}
    for name, target, address in (("aio", router_floor.serve_floor, stub_tcp),
                                  ("aio_unix_socket", router_floor.serve_floor, stub_unix),
                                  ("sync_threads", _serve_sync_relay, stub_tcp)):
        procs.append(ctx.Process(target=target, args=(address, queue), daemon=True))
        procs[-1].start()
        relays[name] = router_pb2_grpc.RouterStub(grpc.insecure_channel(queue.get(timeout=60)[0]))
    direct = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(stub_tcp))
    sampling = common_pb2.SamplingOptions(max_tokens=router_stub.MAX_TOKENS)
    prompt = router_stub.PROMPT

    def one(name: str) -> float:
        t = time.perf_counter()
        if name == "direct":
            list(direct.GenerateLocal(worker_pb2.GenerateLocalRequest(request_id="x", prompt_token_ids=prompt,
                                                                      sampling=sampling)))
        else:
            list(relays[name].Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt),
                                                                  sampling=sampling)))
        return time.perf_counter() - t

    names = ["direct", *relays]
    for name in names:  # warm-up
        for _ in range(50):
            one(name)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            latencies[name] += [one(name) for _ in range(block)]
    for p in procs:
        p.kill()
    p50 = {name: statistics.median(v) * 1e3 for name, v in latencies.items()}
    return {"p50_ms": {k: round(v, 3) for k, v in p50.items()},
            "added_p50_ms": {k: round(v - p50["direct"], 3) for k, v in p50.items() if k != "direct"},
            "calls_per_kind": rounds * block}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=100)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
              "grpcio": grpc.__version__, **measure(args.rounds, args.block)}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
