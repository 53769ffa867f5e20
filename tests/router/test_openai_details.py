"""OpenAI API details as the API and vLLM have them: a non-streaming message's `tool_calls[]` carry no `index`
(only streamed deltas do), `/v1/models` says when the model was created (a Unix time, not 0), and a worker
that stops answering health turns `/ready` false with the reason."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx

from hybridserve.router.config import ResilienceConfig
from hybridserve.router.openai_service import OpenAIService
from hybridserve.router.tool_calls import ToolCall
from hybridserve.router.workers import STALLED_STATUS, WorkerHandle


def test_non_streaming_tool_calls_carry_no_index() -> None:
    assert "index" not in ToolCall("get_weather", '{"city": "Paris"}').body()
    req = SimpleNamespace(parses_tool_calls=True, tool_names={"get_weather", "get_time"})
    text = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]</TOOLCALL>'
    message = OpenAIService._message(req, text, "stop")
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert all("index" not in c and c["type"] == "function" and c["id"].startswith("call_") for c in calls)


def test_models_reports_when_it_was_created(cluster) -> None:
    before = int(time.time())
    data = httpx.get(cluster.base_url + "/v1/models", timeout=10).json()["data"]
    assert 1_700_000_000 < data[0]["created"] <= before + 1


def _handle(**health) -> WorkerHandle:
    from hybridserve.proto import common_pb2
    from hybridserve.router.circuit_breaker import CircuitBreaker

    handle = WorkerHandle("decode", "127.0.0.1:1", None, CircuitBreaker(3, 5.0), unresponsive_after_s=0.2)
    handle.health = common_pb2.HealthResponse(status="ok", **health)
    return handle


def test_an_unanswered_or_stalled_worker_is_not_serving() -> None:
    assert ResilienceConfig().unresponsive_after_s <= 5  # /ready turns within 10 s of a freeze
    handle = _handle()
    assert handle.serving and handle.problem() is None
    handle.waiting_since = time.monotonic()  # a health call went out and is not answered
    assert handle.serving  # not yet: a busy worker answers within ~1 s
    time.sleep(0.3)
    assert not handle.serving and "health unanswered" in (handle.problem() or "")
    handle.waiting_since = None
    assert handle.serving
    handle.health.status = STALLED_STATUS
    assert not handle.serving and handle.problem() == "engine makes no progress"
