"""Tool calling through the live server with the official client: a named tool_choice and 'required' are forced
by the grammar (arguments validate against the tool's parameters), streamed and not; 'none' gives text; a
conversation with tool results renders; the NemotronH and JSON parsers find calls; bad choices are 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from router_cluster import MODEL_NAME, Cluster

from hybridserve.engine.config import EngineConfig
from hybridserve.router.tool_calls import parse_tool_calls  # noqa: E402  (isort groups it with the above)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def cluster(model_dir):
    """The byte tokenizer spells the tools' JSON one token per byte: a longer context than the shared cluster's."""
    c = Cluster(model_dir, engine=EngineConfig(prefill_chunk_size=128, max_num_seqs=8, max_model_len=1024))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_named_and_required_tool_choice(client) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                         tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    required = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                              tool_choice="required", temperature=1.0, seed=3)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name in ("weather", "ping")
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                tool_choice={"type": "function", "function": {"name": "ping"}},
                                                stream=True):
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            streamed.extend(chunk.choices[0].delta.tool_calls)
            assert chunk.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in streamed] == ["ping"]
    assert isinstance(json.loads(streamed[0].function.arguments)["ok"], bool)


def test_tool_choice_none_and_a_conversation_with_tool_results(client) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    again = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=3)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_parsers() -> None:
    names = {"weather"}
    content, calls = parse_tool_calls('Sure.<TOOLCALL>[{"name": "weather", "arguments": {"city": "Oslo"}}]</TOOLCALL>',
                                      names)
    assert content == "Sure." and calls[0].name == "weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    content, calls = parse_tool_calls('{"name": "weather", "arguments": {"days": 2}}', names)
    assert content is None and json.loads(calls[0].arguments) == {"days": 2}
    assert parse_tool_calls("just text", names) == ("just text", [])
    assert parse_tool_calls('{"name": "unknown", "arguments": {}}', names)[1] == []


@pytest.mark.parametrize("body", [
    {"tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
])
def test_bad_tool_choices_are_400(cluster, body) -> None:
    response = httpx.post(cluster.base_url + "/v1/chat/completions",
                          json={"model": MODEL_NAME, "messages": MESSAGES, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert "tool_choice" in response.json()["error"]["message"] or response.json()["error"]["param"] == "tool_choice"
