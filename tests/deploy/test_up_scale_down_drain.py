"""`hybridserve up` scaling down drains the workers it removes: the router stops routing to them, their streams
in flight finish in full, then the actors go (local Ray on this machine, the tiny checkpoint)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from router_cluster import tiny_model_dir

from hybridserve.deploy.cluster_up import UpOptions, down, up
from hybridserve.deploy.options import WorkerOptions
from hybridserve.engine.config import EngineConfig
from hybridserve.router.config import RouterOptions

ray = pytest.importorskip("ray")

ENGINE = EngineConfig(prefill_chunk_size=32, max_num_seqs=8, max_model_len=256)
MAX_TOKENS = 150


def _options(model_dir: str, num_decode: int) -> UpOptions:
    return UpOptions(router=RouterOptions(model_dir, http_port=0, grpc_port=None),
                     worker=WorkerOptions(model_dir, ENGINE, drain_timeout_s=120.0),
                     num_prefill=0, num_decode=num_decode, address="local", timeout_s=240.0)


def _stream(base: str, i: int, started: threading.Semaphore, results: dict[int, object]) -> None:
    body = {"model": "tiny-hybrid", "prompt": [40 + i, 41, 42], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as reply:
            first = True
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first:
                    started.release()
                    first = False
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    results[i] = chunk["usage"]["completion_tokens"]
    except Exception as exc:
        results[i] = exc
        started.release()


@pytest.mark.slow
def test_scale_down_drains_the_removed_decode_worker() -> None:
    model_dir = str(tiny_model_dir())
    ray.init(namespace="hybridserve", include_dashboard=False, log_to_driver=False, num_cpus=4,
             resources={"prefill": 1, "decode": 2})
    try:
        lines = up(_options(model_dir, num_decode=2))
        base = next(line.split()[2] for line in lines if line.startswith("OpenAI API")).removesuffix("/v1")
        started, results = threading.Semaphore(0), {}
        threads = [threading.Thread(target=_stream, args=(base, i, started, results)) for i in range(6)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=120)
        router = ray.get_actor("hybridserve-router")
        # every stream is running; at least one on each decode worker (the policy spreads load)
        up(_options(model_dir, num_decode=1))
        assert "hybridserve-decode-1" not in ray.util.list_named_actors()
        for t in threads:
            t.join(timeout=300)
        assert results == {i: MAX_TOKENS for i in range(6)}
        assert ray.get(router.healthy.remote(), timeout=60) == {"prefill": 0, "decode": 1}
        reply = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": "tiny-hybrid", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    finally:
        try:
            down("local")
        finally:
            ray.shutdown()
