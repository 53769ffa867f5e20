"""Every per-request bound of the front doors, in one table: body size (413), prompt length, n, max_tokens, stop
strings and stop_token_ids (400 with an OpenAI error body naming the problem; INVALID_ARGUMENT on the gRPC
door); concurrent streams per client (429) are in test_limits.py. After the refusals the cluster is idle and
serves normally."""

from __future__ import annotations

import grpc
import httpx
import pytest
from router_cluster import ENGINE, MODEL_NAME

from hybridserve.common.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from hybridserve.proto import router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.router.openai_protocol import MAX_N, MAX_STOP_STRINGS

BASE = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize(("change", "status", "says"), [
    ({"prompt": [5] * ENGINE.max_model_len}, 400, "context length"),
    ({"max_tokens": ENGINE.max_model_len}, 400, "max_tokens"),
    ({"n": MAX_N + 1}, 400, "n"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, 400, "stop"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, 400, "stop_token_ids"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))}, 200, ""),
])
def test_each_http_limit_answers_with_its_status(cluster, change: dict, status: int, says: str) -> None:
    reply = httpx.post(cluster.base_url + "/v1/completions", json={**BASE, **change}, timeout=60)
    assert reply.status_code == status, reply.text
    if status != 200:
        assert says in reply.json()["error"]["message"]
    assert cluster.idle()


def test_a_body_past_the_limit_is_413(cluster) -> None:
    limit = cluster.router.options.max_body_bytes
    reply = httpx.post(cluster.base_url + "/v1/completions", content=b"{" + b" " * limit + b"}",
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 413


def test_too_many_stop_token_ids_on_the_grpc_door_is_invalid_argument(cluster) -> None:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router.grpc_address))
    sampling = sampling_to_proto(SamplingParams(max_tokens=2, temperature=0.0))
    sampling.stop_token_ids.extend(range(MAX_STOP_TOKEN_IDS + 1))
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]), sampling=sampling)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in refused.value.details()
    assert cluster.idle() and cluster.generate([5, 6, 7]) == cluster.generate([5, 6, 7])
