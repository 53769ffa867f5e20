"""Admission control (429 queue full, 503 waited too long), client disconnects abort the work on the
workers (HTTP stream, HTTP non-stream, gRPC), and in-flight request ids are not run twice."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from router_cluster import MODEL_NAME, Cluster

from hybridserve import SamplingParams
from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.router.config import AdmissionConfig
from hybridserve.router.orchestrator import WorkerError

STEP_DELAY_S = 0.05  # slows decoding: a long request (200 tokens, ~10 s) still runs when the client leaves
# a queued request waits this long for the slot before its 503; long enough that the test's next request, sent once
# it sees one queued, still finds the queue full on a loaded 2-core CI machine (0.5 s was not: it got a 503)
QUEUE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def slow(model_dir):
    c = Cluster(model_dir, num_prefill=0, num_decode=1,
                admission=AdmissionConfig(max_running=1, max_queued=1, queue_timeout_s=QUEUE_TIMEOUT_S))
    engine = c.decode[0].engine
    step = engine.step

    def slow_step(**kw):  # type: ignore[no-untyped-def]
        time.sleep(STEP_DELAY_S)
        return step(**kw)

    engine.step = slow_step
    yield c
    c.stop()


def _body(max_tokens: int = 200, stream: bool = False) -> dict:
    return {"model": MODEL_NAME, "prompt": "slow request", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def _busy(cluster: Cluster) -> bool:
    worker = cluster.decode[0]
    return bool(worker.loop.call(worker.engine.has_unfinished))


def _worker_aborts(cluster: Cluster) -> float:
    value = cluster.decode[0].metrics.registry.get_sample_value(
        "hybridserve_worker_requests_total", {"role": "decode", "finish_reason": "abort"})
    return value or 0.0


def test_full_queue_is_429_long_wait_is_503_and_disconnect_aborts(slow) -> None:
    url = slow.base_url + "/v1/completions"
    gone_before, aborts_before = _answered(slow, "499"), _worker_aborts(slow)
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=_body(stream=True)) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the request holds the only slot
        waited: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: waited.append(httpx.post(url, json=_body(4), timeout=30)))
        waiter.start()
        deadline = time.monotonic() + 5
        while slow.router.frontend.admission.queued == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = httpx.post(url, json=_body(4), timeout=30)
        assert refused.status_code == 429 and refused.headers["retry-after"]
        assert refused.json()["error"]["type"] == "server_error" and "queue is full" in refused.json()["error"]["message"]
        waiter.join()
        assert waited[0].status_code == 503 and waited[0].json()["error"]["code"] == "overloaded"
        assert _busy(slow)
    # the client closed the stream long before 200 tokens at STEP_DELAY_S each
    assert slow.idle(timeout=2.0), "the decode worker kept generating after the client left"
    assert slow.router.frontend.admission.running == 0
    assert _answered(slow, "499") == gone_before + 1  # the stream the client closed: not a 200
    assert _worker_aborts(slow) == aborts_before + 1  # and on the worker: finish_reason "abort"
    ok = httpx.post(url, json=_body(4), timeout=30)
    assert ok.status_code == 200


def _answered(cluster: Cluster, status: str, endpoint: str = "/v1/completions") -> float:
    value = cluster.router.metrics.registry.get_sample_value(
        "hybridserve_router_requests_total", {"endpoint": endpoint, "status": status})
    return value or 0.0


def test_non_streaming_disconnect_aborts(slow) -> None:
    gone_before = _answered(slow, "499")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow.base_url + "/v1/completions", json=_body(), timeout=0.5)
    assert slow.idle(timeout=2.0)
    deadline = time.monotonic() + 2
    while slow.router.frontend.admission.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert slow.router.frontend.admission.running == 0
    assert _answered(slow, "499") == gone_before + 1  # counted as the client's disconnect, not as a failure
    assert slow.router.frontend.orchestrator.num_in_flight() == 0


def test_grpc_cancel_aborts(slow) -> None:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(slow.router.grpc_address))
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    before = _answered(slow, "499", "grpc/Generate")
    call = stub.Generate(router_pb2.GenerateRequest(text="cancel me", sampling=sampling_to_proto(params)), timeout=30)
    next(call)
    call.cancel()
    assert slow.idle(timeout=2.0)
    deadline = time.monotonic() + 2
    while _answered(slow, "499", "grpc/Generate") == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _answered(slow, "499", "grpc/Generate") == before + 1


def test_in_flight_request_id_is_not_run_twice(slow) -> None:
    orchestrator = slow.router.orchestrator
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    first = orchestrator.generate([5, 6, 7, 8], params, request_id="same-id")
    next(first)
    with pytest.raises(WorkerError) as again:
        next(orchestrator.generate([5, 6, 7, 8], params, request_id="same-id"))
    assert again.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert orchestrator.abort("same-id")
    with pytest.raises(WorkerError) as aborted:
        list(first)
    assert aborted.value.code == grpc.StatusCode.CANCELLED
    assert slow.idle(timeout=2.0)


def test_grpc_abort_without_keys_is_keyed_by_the_peer_address(slow) -> None:
    """The client's request_id is a label echoed back; without API keys a client is its address, so another
    connection from the same host is the same client and its Abort ends the stream (router/auth.py; keyed
    isolation between clients: test_client_isolation.py)."""
    own = grpc.insecure_channel(slow.router.grpc_address, options=[("grpc.use_local_subchannel_pool", 1)])
    other = grpc.insecure_channel(slow.router.grpc_address, options=[("grpc.use_local_subchannel_pool", 1)])
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    request = router_pb2.GenerateRequest(request_id="mine", text="abort me", sampling=sampling_to_proto(params))
    call = router_pb2_grpc.RouterStub(own).Generate(request, timeout=30)
    assert next(call).event.request_id == "mine"
    assert not router_pb2_grpc.RouterStub(other).Abort(common_pb2.AbortRequest(request_id="other"), timeout=5).found
    next(call)  # still streaming
    assert router_pb2_grpc.RouterStub(other).Abort(common_pb2.AbortRequest(request_id="mine"), timeout=5).found
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    assert slow.idle(timeout=2.0)
    own.close()
    other.close()
