"""Worker-side queues are bounded: a gRPC call past a worker's handler pool, and a request past the engine's
waiting queue (max_num_waiting), are refused at once with RESOURCE_EXHAUSTED (the router answers 429) instead of
queueing without bound; the calls in flight finish and the worker is clean and serving afterwards."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from checkpoints import nemotron_h

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.decode_worker.worker import DecodeWorker
from hybridserve.engine.config import EngineConfig
from hybridserve.proto import worker_pb2, worker_pb2_grpc
from hybridserve.proto.channels import insecure_channel, start_server
from hybridserve.proto.convert import sampling_to_proto


def test_a_call_past_the_handler_pool_is_resource_exhausted() -> None:
    release, inside = threading.Event(), threading.Semaphore(0)

    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        inside.release()
        release.wait(30)
        return request

    class Generic(grpc.GenericRpcHandler):
        def service(self, details):  # noqa: ANN001, ANN201 - grpc's interface
            # only this test's method: a stray client of an earlier test that reconnects to the reused port
            # (a router's cache subscription) gets UNIMPLEMENTED instead of taking a slot of the pool
            return grpc.unary_unary_rpc_method_handler(handler) if details.method == "/t/Echo" else None

    server, port = start_server("127.0.0.1", 0, lambda s: s.add_generic_rpc_handlers((Generic(),)), max_workers=2)
    call = insecure_channel(f"127.0.0.1:{port}").unary_unary("/t/Echo")  # own subchannel (channel_options)
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(call, b"x", timeout=30) for _ in range(2)]
            assert inside.acquire(timeout=10) and inside.acquire(timeout=10)  # the pool is full
            with pytest.raises(grpc.RpcError) as refused:
                call(b"y", timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            release.set()
            assert [f.result() for f in held] == [b"x", b"x"]
        assert call(b"z", timeout=10) == b"z"
    finally:
        server.stop(0)


def test_a_request_past_the_waiting_queue_is_resource_exhausted() -> None:
    model_dir, _ = nemotron_h("M*")
    worker = DecodeWorker(model_dir, EngineConfig(max_num_seqs=1, max_num_waiting=1, max_model_len=256), metrics_port=None)
    step = worker.engine.step
    worker.engine.step = lambda **kw: (time.sleep(0.02), step(**kw))[1]  # type: ignore[method-assign]
    stub = worker_pb2_grpc.DecodeWorkerStub(insecure_channel(worker.start()))

    def generate(i: int, max_tokens: int = 24):  # noqa: ANN202 - a gRPC response iterator
        params = sampling_to_proto(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return stub.GenerateLocal(worker_pb2.GenerateLocalRequest(request_id=f"r{i}", prompt_token_ids=[5, 6, 7 + i],
                                                                  sampling=params), timeout=60)

    def waiting() -> int:
        return len(worker.engine.scheduler.waiting)  # read from this thread: the loop is busy stepping

    try:
        first = generate(0, max_tokens=200)  # 200 steps of >= 20 ms: it holds the one slot for seconds
        next(first)  # running: it holds the one slot
        second = generate(1)  # sent only now: it cannot overtake the first
        deadline = time.monotonic() + 10
        while waiting() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting() == 1  # the second waits
        with pytest.raises(grpc.RpcError) as refused:
            list(generate(2))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_num_waiting" in refused.value.details()
        assert sum(len(e.token_ids) for e in second) == 24 and list(first)  # both served in full
        assert sum(len(e.token_ids) for e in generate(3)) == 24  # room again
        assert not worker.loop.call(worker.engine.has_unfinished)
        worker.loop.call(worker.engine.pool.check)
    finally:
        worker.stop(grace=0)
