"""The OpenAI client against the router's HTTP door (and the gRPC door): tokens equal the offline LLM,
usage reports cached tokens, bad input gets OpenAI error bodies, /metrics parses and moves."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_cluster import MODEL_NAME

from hybridserve import LLM, SamplingParams
from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(str(model_dir))

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return llm.generate(prompt_token_ids=[prompt_ids], sampling_params=params)[0].token_ids

    return run


def test_completion_tokens_equal_offline_and_repeat_is_cached(client, offline) -> None:
    first = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})
    prompt_ids = first.model_extra["prompt_token_ids"]
    choice = first.choices[0]
    assert choice.model_extra["token_ids"] == offline(prompt_ids, 6)
    assert first.usage.prompt_tokens == len(prompt_ids) and first.usage.completion_tokens == 6
    assert choice.finish_reason == "length"
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert again.choices[0].text == choice.text
    assert again.usage.prompt_tokens_details.cached_tokens == 32  # the checkpoint at 32 of 62 tokens


def test_streaming_completion_with_usage_and_token_id_prompt(client, offline) -> None:
    prompt_ids = list(range(40, 75))
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    tokens = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert tokens == offline(prompt_ids, 5)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_not_agree(client) -> None:
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_seed_and_stop(client) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9,
                                    seed=7, n=3, extra_body={"top_k": 50, "return_token_ids": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2] and out.usage.completion_tokens == 24
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9,
                                      seed=7, n=3, extra_body={"top_k": 50, "return_token_ids": True})
    assert [c.model_extra["token_ids"] for c in again.choices] == [c.model_extra["token_ids"] for c in out.choices]
    text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = text[3:5]
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[: text.find(stop)]


def test_grpc_generate_matches_http_and_reflection_is_on(cluster, client) -> None:
    http = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"return_token_ids": True})
    channel = grpc.insecure_channel(cluster.router.grpc_address)
    stub = router_pb2_grpc.RouterStub(channel)
    request = router_pb2.GenerateRequest(text=PROMPT, sampling=sampling_to_proto(SamplingParams(max_tokens=6, temperature=0)))
    replies = list(stub.Generate(request, timeout=60))
    assert [t for r in replies for t in r.event.token_ids] == http.choices[0].model_extra["token_ids"]
    assert "".join(r.text_delta for r in replies) == http.choices[0].text
    assert replies[-1].event.finish_reason == "length" and replies[-1].event.num_prompt_tokens == len(PROMPT)
    assert stub.Health(common_pb2.HealthRequest(), timeout=5).role == "router"
    assert not stub.Abort(common_pb2.AbortRequest(request_id="nope"), timeout=5).found
    with pytest.raises(grpc.RpcError) as bad:
        list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 999])), timeout=10))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "hybridserve.v1.Router" in {s.name for s in answer.list_services_response.service}


def _post(cluster, path: str, content: bytes | str) -> httpx.Response:
    return httpx.post(cluster.base_url + path, content=content, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ('{"model": "tiny-hybrid", "prompt": "hi", "temperature": 5}', 400, "temperature"),
    ('{"model": "tiny-hybrid", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ('{"model": "tiny-hybrid", "prompt": "hi", "max_tokens": 100000}', 400, "max_tokens"),
    ('{"model": "tiny-hybrid", "prompt": "' + "x" * 300 + '"}', 400, "prompt"),
    ('{"model": "tiny-hybrid", "prompt": [5, 999]}', 400, "prompt"),
    ('{"model": "tiny-hybrid", "prompt": "hi", "n": 0}', 400, "n"),
    ('{"model": "tiny-hybrid", "prompt": "hi", "logprobs": 21}', 400, "logprobs"),
    ('{"model": "tiny-hybrid", "prompt": "hi", "colour": "red"}', 400, "colour"),
    ('{"model": "no-such-model", "prompt": "hi"}', 404, "model"),
])
def test_bad_requests_get_openai_error_bodies(cluster, body, status, param) -> None:
    response = _post(cluster, "/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_openai_client_raises_typed_errors(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "wizard", "content": "hi"}])


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text
    return {f"{s.name}{sorted(s.labels.items())}": s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def test_metrics_parse_and_move_and_targets_list_everything(cluster, client) -> None:
    before = _scrape(cluster.base_url + "/metrics")
    client.completions.create(model=MODEL_NAME, prompt=PROMPT + " metrics", max_tokens=3, temperature=0)
    after = _scrape(cluster.base_url + "/metrics")
    key = "hybridserve_router_requests_total[('endpoint', '/v1/completions'), ('status', '200')]"
    assert after[key] == before.get(key, 0) + 1
    assert after["hybridserve_router_time_to_first_token_seconds_count[]"] > before.get(
        "hybridserve_router_time_to_first_token_seconds_count[]", 0)
    assert any(k.startswith("hybridserve_router_routing_decisions_total") for k in after)
    assert any(k.startswith("hybridserve_router_prefix_index_hit_ratio") for k in after)
    targets = httpx.get(cluster.base_url + "/targets", timeout=10).json()
    components = sorted(g["labels"]["component"] for g in targets)
    assert components == ["decode_worker", "prefill_worker", "router"]
    for group in targets[1:]:
        worker = _scrape(f"http://{group['targets'][0]}/metrics")
        assert any(k.startswith("hybridserve_worker_generation_tokens_total") and v > 0 for k, v in worker.items())
        assert any(k.startswith("hybridserve_worker_kv_cache_usage_ratio") for k in worker)
        assert any(k.startswith("hybridserve_worker_prefix_cache_queries_total") for k in worker)
        # where a worker's time goes: decode-only step phases, the collector's pauses by generation
        assert any(k.startswith("hybridserve_worker_engine_decode_only_phase_seconds_total") and "'wait'" in k
                   for k in worker)
        assert any(k.startswith("hybridserve_worker_gc_pause_seconds_total") and "'generation', '2'" in k
                   for k in worker)
    prefill = _scrape(f"http://{targets[1]['targets'][0]}/metrics")
    assert any(k.startswith("hybridserve_worker_transfer_bytes_total") and v > 0 for k, v in prefill.items())
    assert any(k.startswith("hybridserve_worker_prefix_cache_hit_tokens_total") and v > 0 for k, v in prefill.items())


def test_models_health_ready(cluster) -> None:
    models = httpx.get(cluster.base_url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert httpx.get(cluster.base_url + "/health", timeout=10).status_code == 200
    ready = httpx.get(cluster.base_url + "/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["healthy_workers"] == {"prefill": 1, "decode": 1}


def test_tokenize_and_detokenize(cluster) -> None:
    for path in ("/tokenize", "/v1/tokenize"):
        out = httpx.post(cluster.base_url + path, json={"model": MODEL_NAME, "prompt": "héllo"}, timeout=10).json()
        assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] > 0
        back = httpx.post(cluster.base_url + path.replace("tokenize", "detokenize"),
                          json={"model": MODEL_NAME, "tokens": out["tokens"]}, timeout=10).json()
        assert back["prompt"] == "héllo"
    chat = httpx.post(cluster.base_url + "/tokenize", timeout=10,
                      json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2  # the chat template's framing around "hi"
    for body, param in (({"model": MODEL_NAME}, None), ({"model": MODEL_NAME, "prompt": "a", "messages": []}, None),
                        ({"model": "other", "prompt": "a"}, "model")):
        bad = httpx.post(cluster.base_url + "/tokenize", json=body, timeout=10)
        assert bad.status_code in (400, 404) and "error" in bad.json()
        if param:
            assert bad.json()["error"]["param"] == param
    oov = httpx.post(cluster.base_url + "/detokenize", json={"model": MODEL_NAME, "tokens": [1, 10**9]}, timeout=10)
    assert oov.status_code == 400 and oov.json()["error"]["param"] == "tokens"


def test_clients_sharing_an_x_request_id_do_not_collide(cluster) -> None:
    """Three concurrent streams with one x-request-id each get their whole answer; the header is echoed."""
    import concurrent.futures

    body = {"model": MODEL_NAME, "prompt": [40, 41, 42, 43], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}

    def stream() -> tuple[list[int], str]:
        tokens: list[int] = []
        with httpx.stream("POST", cluster.base_url + "/v1/completions", json=body, timeout=60,
                          headers={"x-request-id": "same-id"}) as response:
            echoed = response.headers["x-request-id"]
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        tokens += choice.get("token_ids") or []
        return tokens, echoed

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: stream(), range(3)))
    assert all(echoed == "same-id" for _, echoed in results)
    assert all(len(tokens) == 12 for tokens, _ in results)
    assert results[0][0] == results[1][0] == results[2][0]


def test_generation_fast_path_leaves_other_methods_and_paths_to_fastapi(cluster) -> None:
    """The generation routes are served in front of FastAPI for POST only: other methods get FastAPI's 405,
    unknown paths its 404, and a POST still answers as the route does."""
    url = cluster.base_url + "/v1/completions"
    assert httpx.get(url, timeout=10).status_code == 405
    assert httpx.post(cluster.base_url + "/v1/completion", json={}, timeout=10).status_code == 404
    ok = httpx.post(url, json={"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0},
                    headers={"x-request-id": "label-1"}, timeout=60)
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "label-1"
    assert ok.json()["usage"]["completion_tokens"] == 2
