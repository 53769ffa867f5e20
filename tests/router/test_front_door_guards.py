"""Front-door guards: --api-key (the API routes and every gRPC call need the key; health, readiness and metrics
stay open) and the request body limit (413)."""

from __future__ import annotations

import grpc
import httpx
import pytest
from router_cluster import MODEL_NAME, Cluster, tiny_model_dir

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.proto import router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto

KEY = "s3cret"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(tiny_model_dir(), num_prefill=0, api_key=KEY)
    yield c
    c.stop()


def test_http_v1_needs_the_key(cluster) -> None:
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(cluster.base_url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(cluster.base_url + "/v1/models", timeout=10).status_code == 401
    ok = httpx.post(cluster.base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    tokenize = {"model": MODEL_NAME, "prompt": "hi"}
    assert httpx.post(cluster.base_url + "/tokenize", json=tokenize, timeout=10).status_code == 401
    assert httpx.post(cluster.base_url + "/tokenize", json=tokenize, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=10).status_code == 200
    for open_path in ("/health", "/metrics"):
        assert httpx.get(cluster.base_url + open_path, timeout=10).status_code == 200


def test_grpc_needs_the_key(cluster) -> None:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router.grpc_address))
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]),
                                         sampling=sampling_to_proto(SamplingParams(max_tokens=2, temperature=0.0)))
    with pytest.raises(grpc.RpcError) as denied:
        list(stub.Generate(request, timeout=30))
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    events = list(stub.Generate(request, timeout=60, metadata=[("authorization", f"Bearer {KEY}")]))
    assert sum(len(r.event.token_ids) for r in events) == 2


def test_an_oversized_body_gets_413() -> None:
    c = Cluster(tiny_model_dir(), num_prefill=0, max_body_bytes=2000)
    try:
        big = {"model": MODEL_NAME, "prompt": [5] * 1000, "max_tokens": 1}
        response = httpx.post(c.base_url + "/v1/completions", json=big, timeout=30)
        assert response.status_code == 413 and "2000" in response.json()["error"]["message"]
        small = {"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": 1, "temperature": 0}
        assert httpx.post(c.base_url + "/v1/completions", json=small, timeout=60).status_code == 200
    finally:
        c.stop()
