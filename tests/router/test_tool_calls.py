"""Tool calling through the live server with the official client: a named tool_choice and 'required' are forced
by the grammar (arguments validate against the tool's parameters), streamed and not; 'none' gives text; a
conversation with tool results renders; the NemotronH and JSON parsers find calls; bad choices are 400."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest
from router_cluster import MODEL_NAME, Cluster

from hybridserve.engine.config import EngineConfig
from hybridserve.router.tool_call_stream import ToolCallStream
from hybridserve.router.tool_calls import parse_tool_calls

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
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200, stream=True,
        tool_choice={"type": "function", "function": {"name": "weather"}}))
    content, calls, fragments = reassemble(chunks)
    assert content == "" and [name for name, _ in calls] == ["weather"] and fragments[0] > 3  # arguments streamed
    jsonschema.validate(json.loads(calls[0][1]), WEATHER)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def reassemble(chunks) -> tuple[str, list[tuple[str, str]], list[int]]:
    """A streamed chat choice put back together: its content, its calls (name, arguments) in index order, and
    how many deltas carried each call's arguments. Each call's first delta has id, type and name."""
    content, calls, fragments = "", {}, {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id.startswith("call_") and call.type == "function" and call.function.name
                calls[call.index], fragments[call.index] = [call.function.name, ""], 0
            else:
                assert call.id is None and not call.function.name
            calls[call.index][1] += call.function.arguments or ""
            fragments[call.index] += bool(call.function.arguments)
    return content, [tuple(calls[i]) for i in sorted(calls)], [fragments[i] for i in sorted(fragments)]


def test_streamed_nemotron_tool_calls_come_as_name_then_argument_fragments(client) -> None:
    """The model is held to NemotronH's format by a regex (the tiny model does not write it by itself)."""
    regex = (r'Sure\. <TOOLCALL>\[\{"name": "weather", "arguments": \{"city": "[a-z]{1,6}", "days": [1-7]\}\}, '
             r'\{"name": "ping", "arguments": \{"ok": (true|false)\}\}\]</TOOLCALL>')
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                 stream=True, temperature=0.0, extra_body={"guided_regex": regex}))
    content, calls, fragments = reassemble(chunks)
    assert content == "Sure." and [name for name, _ in calls] == ["weather", "ping"]
    jsonschema.validate(json.loads(calls[0][1]), WEATHER)
    assert set(json.loads(calls[1][1])) == {"ok"} and min(fragments) > 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                           temperature=0.0, extra_body={"guided_regex": regex})
    message = whole.choices[0].message
    assert message.content == content and [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (name, json.dumps(json.loads(arguments))) for name, arguments in calls]


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


@pytest.mark.parametrize("text", [
    'Sure.<TOOLCALL>[{"name": "weather", "arguments": {"city": "Oslo", "d": [1, {"x": "}"}]}}, '
    '{"arguments": {"ok": true}, "name": "ping"}]</TOOLCALL>',
    '{"name": "weather", "arguments": {"days": 2}}',
    '[{"name":"ping","arguments":{"ok":false}}, {"name": "weather", "parameters": {}}]',
    '{"name": "ping", "arguments": "{\\"ok\\": true}"}',
    "  just text <TOOL and more ",
    '{"name": "unknown", "arguments": {}}',
    '{"a": 1}',
    'text <TOOLCALL>[{"name": "nope", "arguments": {}}]</TOOLCALL>',
])
def test_the_tool_call_stream_equals_the_parser_however_the_text_is_split(text: str) -> None:
    rng = random.Random(0)
    for _ in range(10):
        stream, deltas, at = ToolCallStream({"weather", "ping"}), [], 0
        while at < len(text):
            size = rng.randint(1, 6)
            deltas.append(stream.feed(text[at : at + size]))
            at += size
        deltas.append(stream.finish())
        calls: dict[int, list[str]] = {}
        for d in deltas:
            for call in d.get("tool_calls", []):
                calls.setdefault(call["index"], [call["function"].get("name", ""), ""])[1] += call["function"]["arguments"]
        content, expected = parse_tool_calls(text, {"weather", "ping"})
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        assert [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))] == [
            (c.name, json.loads(c.arguments)) for c in expected]
        assert stream.has_calls == bool(expected)


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
