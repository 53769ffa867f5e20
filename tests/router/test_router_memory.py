"""Nothing in the router grows per request: after a mixed batch (completions and chat, streamed and not, streams
the client leaves early, refused requests, the gRPC door) the per-request tables are back at their base size,
the metric label sets are the ones the first batch made, the prefix index holds exactly what the workers' caches
hold, and the workers' cache-event replay buffers stay within their bound (no wall-clock asserts)."""

from __future__ import annotations

import time

import grpc
import httpx
from router_cluster import MODEL_NAME, Cluster

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.proto import router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.worker_runtime.cache_event_feed import FEED_CAPACITY


def _batch(cluster: Cluster, start: int, count: int) -> None:
    base, model = cluster.base_url, MODEL_NAME
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router.grpc_address))
    with httpx.Client(base_url=base, timeout=60) as client:
        for i in range(start, start + count):
            prompt = [5 + (i * 7 + k) % 250 for k in range(3 + i % 37)]
            kind = i % 7
            if kind == 0:
                client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 3})
            elif kind == 1:
                with client.stream("POST", "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 3,
                                                                     "stream": True}) as reply:
                    list(reply.iter_lines())
            elif kind == 2:
                client.post("/v1/chat/completions", json={"model": model, "max_tokens": 3,
                                                          "messages": [{"role": "user", "content": f"hi {i}"}]})
            elif kind == 3:
                with client.stream("POST", "/v1/chat/completions", json={
                        "model": model, "max_tokens": 3, "stream": True,
                        "messages": [{"role": "user", "content": f"yo {i}"}]}) as reply:
                    list(reply.iter_lines())
            elif kind == 4:  # the client leaves mid-stream
                with client.stream("POST", "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 64,
                                                                     "stream": True, "ignore_eos": True}) as reply:
                    for k, _ in enumerate(reply.iter_lines()):
                        if k > 2:
                            break
            elif kind == 5:  # refused: context too long, unknown model, bad JSON
                client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 100_000})
                client.post("/v1/completions", json={"model": "nope", "prompt": prompt})
                client.post("/v1/completions", content=b"{bad json", headers={"content-type": "application/json"})
            else:
                request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt), sampling=sampling_to_proto(
                    SamplingParams(max_tokens=3, temperature=0.0)))
                list(stub.Generate(request, timeout=60))


def _metric_series(cluster: Cluster) -> int:
    return sum(len(m.samples) for m in cluster.router.metrics.registry.collect())


def _worker_blocks(cluster: Cluster) -> set[str]:
    hashes: set[str] = set()
    for w in cluster.prefill + cluster.decode:
        hashes |= w.loop.call(lambda w=w: {n.block_hash.hex() for n in w.engine.pool.radix.nodes()})
    return hashes


def _index_mirrors_the_workers(cluster: Cluster, timeout: float = 30.0) -> bool:
    """The subscribers follow the workers' events: wait until the index holds exactly the workers' blocks."""
    index = cluster.orchestrator.index
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if set(index._nodes) == _worker_blocks(cluster):
            return True
        time.sleep(0.1)
    return False


def test_nothing_grows_per_request(cluster: Cluster) -> None:
    _batch(cluster, 0, 42)  # every kind of request once or more: the label sets exist now
    assert cluster.idle()
    series = _metric_series(cluster)
    _batch(cluster, 42, 140)
    assert cluster.idle()
    orchestrator, admission = cluster.orchestrator, cluster.router.frontend.admission
    assert orchestrator._active == {}
    assert admission.running == 0 and admission._per_client == {}
    assert len(orchestrator.recent_decisions) <= orchestrator.recent_decisions.maxlen
    assert _metric_series(cluster) == series  # no label set per request, per id or per client
    assert _index_mirrors_the_workers(cluster)  # nothing kept that no worker holds
    for w in cluster.prefill + cluster.decode:
        assert len(w.events._buffer) <= FEED_CAPACITY
    cluster.check_pools()
