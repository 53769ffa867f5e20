"""Every bad input is a 4xx in the OpenAI error shape (HTTP) or INVALID_ARGUMENT (gRPC), by the same checks on
both doors: deep JSON nesting, lone surrogates, NaN, unknown paths and wrong methods, long request ids, too
many or too long stop strings, infinite temperatures, max_tokens 0, malformed protobuf; a 500 names no internals.
The gRPC stream carries the request id once and ends with a usage summary."""

from __future__ import annotations

import grpc
import httpx
import pytest
from router_cluster import MODEL_NAME, Cluster

from hybridserve import SamplingParams
from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto


@pytest.fixture(scope="module")
def http(cluster: Cluster):
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def stub(cluster: Cluster):
    assert cluster.router is not None
    channel = grpc.insecure_channel(cluster.router.grpc_address)
    yield router_pb2_grpc.RouterStub(channel)
    channel.close()


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_deep_nesting_is_400_not_a_recursion_error(http: httpx.Client) -> None:
    for depth in (100_000, 200):
        raw = '{"model": "' + MODEL_NAME + '", "prompt": "hi", "user": ' + "[" * depth + "]" * depth + "}"
        error = openai_error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
                             400)
        assert "nests JSON deeper than" in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a\ud800b"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}]}),
    ("/v1/completions", {"prompt": "ok", "stop": ["\ud800"]}),
])
def test_lone_surrogates_are_400(http: httpx.Client, path: str, body: dict) -> None:
    import json

    raw = json.dumps({"model": MODEL_NAME, "max_tokens": 2, **body})  # ensure_ascii: "\ud800" stays escaped
    error = openai_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert "lone UTF-16 surrogate" in error["message"]


def test_nan_and_infinity_are_400(http: httpx.Client) -> None:
    raw = '{"model": "' + MODEL_NAME + '", "prompt": "hi", "temperature": NaN}'
    error = openai_error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert "NaN is not a JSON number" in error["message"]


def test_unknown_paths_and_wrong_methods_have_the_openai_shape(http: httpx.Client) -> None:
    error = openai_error(http.get("/v1/nothing-here"), 404)
    assert error["code"] == "not_found" and "/v1/nothing-here" in error["message"]
    error = openai_error(http.get("/v1/completions"), 405)
    assert error["code"] == "method_not_allowed" and "GET" in error["message"]
    openai_error(http.delete("/v1/models"), 405)


def test_validation_messages_have_no_pydantic_prefix(http: httpx.Client) -> None:
    error = openai_error(http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x",
                                                            "stop": ["a", "b", "c", "d", "e"]}), 400)
    assert "Value error" not in error["message"] and error["message"].startswith("stop: stop takes at most")


def test_a_long_request_id_header_is_400(http: httpx.Client) -> None:
    error = openai_error(http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1},
                                   headers={"x-request-id": "r" * 257}), 400)
    assert error["param"] == "x-request-id"


def test_a_bug_is_a_500_in_the_openai_shape_naming_no_internals(cluster: Cluster, http: httpx.Client,
                                                               monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom at /secret/site-packages/x.py via 10.1.2.3:5555")

    assert cluster.router is not None
    monkeypatch.setattr(cluster.router.frontend, "max_tokens_for", broken)
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
    error = openai_error(response, 500)
    assert "request id" in error["message"] and "secret" not in response.text and "10.1.2.3" not in response.text
    assert "boom" in caplog.text  # the details are in the log


def generate(stub, sampling: common_pb2.SamplingOptions, request_id: str = "", text: str = "hello") -> list:
    request = router_pb2.GenerateRequest(request_id=request_id, text=text, sampling=sampling)
    return list(stub.Generate(request, timeout=60))


@pytest.mark.parametrize("sampling, words", [
    (common_pb2.SamplingOptions(max_tokens=4, stop=["x"] * 10_000), "stop takes at most"),
    (common_pb2.SamplingOptions(max_tokens=4, stop=["x" * 5000]), "characters; at most"),
    (common_pb2.SamplingOptions(max_tokens=4, temperature=float("inf")), "temperature must be"),
    (common_pb2.SamplingOptions(max_tokens=4, temperature=float("nan")), "temperature must be"),
    (common_pb2.SamplingOptions(max_tokens=4, temperature=2.5), "temperature must be"),
    (common_pb2.SamplingOptions(max_tokens=4, repetition_penalty=float("nan")), "repetition_penalty"),
    (common_pb2.SamplingOptions(max_tokens=0), "max_tokens must be a positive integer"),
    (common_pb2.SamplingOptions(max_tokens=10**6), "max_tokens=1000000 is too large"),
])
def test_grpc_refuses_what_http_refuses(stub, sampling: common_pb2.SamplingOptions, words: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        generate(stub, sampling)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in refused.value.details()


def test_grpc_request_ids_are_bounded_and_sent_once_and_usage_ends_the_stream(stub) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        generate(stub, common_pb2.SamplingOptions(max_tokens=2), request_id="r" * (1 << 20))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 256" in refused.value.details()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    responses = generate(stub, sampling_to_proto(params), request_id="label-1")
    assert responses[0].event.request_id == "label-1"
    assert all(r.event.request_id == "" for r in responses[1:]) and len(responses) > 1
    last = responses[-1]
    assert last.event.finish_reason == "length" and last.HasField("usage")
    assert not any(r.HasField("usage") for r in responses[:-1])
    tokens = sum(len(r.event.token_ids) for r in responses)
    assert last.usage.completion_tokens == tokens == 6
    assert last.usage.prompt_tokens == last.event.num_prompt_tokens == len("hello")  # the byte tokenizer
    assert last.usage.total_tokens == 6 + len("hello")


def test_grpc_max_tokens_unset_is_16(stub) -> None:
    responses = generate(stub, common_pb2.SamplingOptions(temperature=0, ignore_eos=True))
    assert responses[-1].usage.completion_tokens == 16


def test_malformed_protobuf_is_invalid_argument(cluster: Cluster) -> None:
    assert cluster.router is not None
    channel = grpc.insecure_channel(cluster.router.grpc_address)
    raw = channel.unary_stream("/hybridserve.v1.Router/Generate", request_serializer=None,
                               response_deserializer=None)
    with pytest.raises(grpc.RpcError) as refused:
        list(raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=10))  # field 1, a length far beyond the message
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed GenerateRequest" in refused.value.details()
    health = channel.unary_unary("/hybridserve.v1.Router/Health", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as refused:
        health(b"\xff", timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
