"""Tool calls round-trip through langchain-openai's ChatOpenAI with `bind_tools`, against a live disaggregated
server with the demo model: the call is forced with tool_choice (grammar-enforced, so the small model writes a
valid one), its arguments validate, streamed chunks add up to the same call, and the tool's result goes back
in a second turn that renders and answers."""

from __future__ import annotations

import jsonschema
import pytest
from router_cluster import MODEL_NAME, Cluster

from hybridserve.engine.config import EngineConfig
from hybridserve.models.default_model import default_model_dir

langchain_openai = pytest.importorskip("langchain_openai")
messages_module = pytest.importorskip("langchain_core.messages")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "weather", "description": "Forecast", "parameters": WEATHER}}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(default_model_dir(), engine=EngineConfig(prefill_chunk_size=128, max_num_seqs=4, max_model_len=1024))
    yield c
    c.stop()


def test_bind_tools_round_trip(cluster) -> None:
    llm = langchain_openai.ChatOpenAI(model=MODEL_NAME, base_url=cluster.base_url + "/v1", api_key="unused",
                                      max_retries=0, timeout=120, temperature=0.0, max_tokens=120)
    forced = llm.bind_tools([TOOL], tool_choice="weather")
    question = messages_module.HumanMessage("Weather in Oslo for two days?")
    reply = forced.invoke([question])
    (call,) = reply.tool_calls
    assert call["name"] == "weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER)
    streamed = None
    for chunk in forced.stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and [(c["name"], c["args"]) for c in streamed.tool_calls] == [("weather", call["args"])]
    result = messages_module.ToolMessage("rain all week", tool_call_id=call["id"])
    answer = llm.bind_tools([TOOL]).invoke([question, reply, result])
    assert isinstance(answer, messages_module.AIMessage)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
