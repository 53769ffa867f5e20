"""The router benchmarks' stand-ins: a stub decode worker that answers at once (gRPC and socket sessions), the
router over it, each in a process of its own, and a process's CPU clock (bench/serving/router_overhead.py,
router_relay_variants.py, router_cpu_ab.py)."""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from hybridserve.proto import common_pb2, worker_pb2, worker_pb2_grpc

PROMPT = list(range(10, 74))  # 64 tokens
MAX_TOKENS = 4


class StubDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Answers like a decode worker that generates instantly; caches nothing. With `sessions` its Health offers
    the Session stream (the router sends local requests there), where it sends each token in a message of its
    own, as a worker stepping one request would: the router relays as many events either way."""

    def __init__(self, sessions: bool = True) -> None:
        self.sessions = sessions
        self.session_port = 0  # its socket session's port (worker_runtime/session_socket.py), once serving

    def GenerateLocal(self, request, context):  # noqa: N802
        yield from stub_events(request)

    def Session(self, request_iterator, context):  # noqa: N802
        for request in request_iterator:
            if request.WhichOneof("kind") == "generate":
                for event in stub_events(request.generate):
                    yield worker_pb2.SessionEvents(events=[event])

    def Health(self, request, context):  # noqa: N802
        return common_pb2.HealthResponse(status="ok", role="decode", block_size=16, state_block=32,
                                         total_state_slots=1024, free_state_slots=1024, max_model_len=4096,
                                         sessions=self.sessions, session_port=self.session_port)

    def CacheEvents(self, request, context):  # noqa: N802
        yield common_pb2.CacheEventBatch(worker_id="stub", snapshot=True)
        while context.is_active():
            time.sleep(0.2)

    def Abort(self, request, context):  # noqa: N802
        return common_pb2.AbortResponse(found=False)


def stub_events(request: worker_pb2.GenerateLocalRequest):
    """The events of a request answered at once: max_tokens tokens (16 without), the last one finishing it."""
    n = request.sampling.max_tokens or 16
    for i in range(n):
        yield common_pb2.TokenEvent(request_id=request.request_id, token_ids=[65 + i % 26],
                                    finish_reason="length" if i == n - 1 else "",
                                    num_prompt_tokens=len(request.prompt_token_ids))


def serve_stub(queue, sessions: bool = True) -> None:
    """Child process: the stub decode worker, until killed (a process of its own, like a real worker, so the
    router's CPU time is its own)."""
    from hybridserve.worker_runtime.session_socket import SessionSocketServer

    stub = StubDecode(sessions)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(stub, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    if sessions:  # the same Session handler on a socket, as a decode worker serves it
        stub.session_port = SessionSocketServer("127.0.0.1", 0, stub.Session, None).start()
    queue.put(f"127.0.0.1:{port}")
    threading.Event().wait()


def serve_router(model_dir: str, stub_address: str, queue, socket_sessions: bool = True) -> None:
    """Child process: the router over the stub worker, until killed; its sessions with the stub over the stub's
    socket session, or with `socket_sessions=False` over gRPC streams."""
    from hybridserve.router.app import Router, RouterOptions
    from hybridserve.router.config import AdmissionConfig, OrchestratorConfig

    options = RouterOptions(model_dir, model_name="bench", http_port=0, grpc_port=0, max_model_len=4096,
                            admission=AdmissionConfig(max_running=1024, max_queued=4096),
                            orchestrator=OrchestratorConfig(worker_socket_sessions=socket_sessions))
    router = Router(options, [], [stub_address]).start()
    time.sleep(1.0)  # first health poll and event snapshot
    queue.put((router.grpc_address, router.http_address))
    threading.Event().wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
