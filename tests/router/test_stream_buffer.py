"""The router's bounded per-stream read-ahead: a client that stops reading gets its request aborted on the
worker and its stream ended with RESOURCE_EXHAUSTED; one that reads slowly (but within the stall timeout)
gets every event. A stub decode worker (no model) streams as fast as gRPC lets it."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.proto import common_pb2, worker_pb2_grpc
from hybridserve.router.config import OrchestratorConfig, ResilienceConfig
from hybridserve.router.orchestrator import Orchestrator, WorkerError

STALL_S = 0.3
BUFFER = 4


class StubDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Generates max_tokens events at once; records aborts and the end of its streams (the RPC terminated)."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.ended = threading.Event()

    def GenerateLocal(self, request, context):  # noqa: N802
        context.add_callback(self.ended.set)
        n = request.sampling.max_tokens
        for i in range(n):
            yield common_pb2.TokenEvent(request_id=request.request_id, token_ids=[i % 300],
                                        finish_reason="length" if i == n - 1 else "")

    def Health(self, request, context):  # noqa: N802
        return common_pb2.HealthResponse(status="ok", role="decode", block_size=16, state_block=32,
                                         total_state_slots=64, free_state_slots=64, max_model_len=1 << 20)

    def Abort(self, request, context):  # noqa: N802
        self.aborted.append(request.request_id)
        return common_pb2.AbortResponse(found=True)


@pytest.fixture()
def routed():
    stub = StubDecode()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(stub, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    config = OrchestratorConfig(resilience=ResilienceConfig(stream_buffer_events=BUFFER, stream_stall_timeout_s=STALL_S,
                                                            health_interval_s=0.05))
    orchestrator = Orchestrator([], [f"127.0.0.1:{port}"], config, subscribe_cache_events=False)
    deadline = time.monotonic() + 10
    while orchestrator.workers.all()[0].health is None:
        assert time.monotonic() < deadline, "the stub worker never answered a health check"
        time.sleep(0.02)
    yield orchestrator, stub
    orchestrator.close()
    server.stop(0)


def test_a_client_that_stops_reading_is_aborted(routed) -> None:
    orchestrator, stub = routed
    events = orchestrator.generate([1, 2, 3], SamplingParams(max_tokens=100_000, ignore_eos=True), request_id="stops")
    next(events)
    time.sleep(STALL_S * 4)  # the buffer fills, stays full past the stall timeout
    with pytest.raises(WorkerError) as ended:
        next(events)
    assert ended.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "did not read" in str(ended.value)
    deadline = time.monotonic() + 5
    while "stops" not in stub.aborted or not stub.ended.is_set():
        assert time.monotonic() < deadline, "the worker was not aborted"
        time.sleep(0.02)
    assert orchestrator.num_in_flight() == 0
    assert orchestrator.workers.all()[0].session() is None  # Health does not offer sessions: GenerateLocal calls


def test_a_slow_reader_within_the_timeout_gets_everything(routed) -> None:
    orchestrator, stub = routed
    tokens = []
    for event in orchestrator.generate([1, 2, 3], SamplingParams(max_tokens=3 * BUFFER, ignore_eos=True)):
        tokens += event.token_ids
        time.sleep(STALL_S / 4)
    assert tokens == list(range(3 * BUFFER))
    assert not stub.aborted
