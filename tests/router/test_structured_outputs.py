"""Structured outputs over a disaggregated server with MTP on (the demo model): random JSON schemas through
response_format always parse and validate, json_object parses, guided_choice / guided_regex hold, streamed and
not; the first token comes from the prefill worker under the same grammar. Bad grammars get a 400."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from router_cluster import MODEL_NAME, Cluster

from hybridserve.engine.config import EngineConfig
from hybridserve.models.default_model import default_model_dir

NUM_SCHEMAS = 24  # the 100 took ~4x as long on 2 shared CPU cores; the generator covers the same shapes
ENGINE = EngineConfig(prefill_chunk_size=64, max_num_seqs=8, max_model_len=512,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(default_model_dir(), num_prefill=1, num_decode=1, engine=ENGINE)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Objects, arrays, bounded strings / integers, enums and booleans: every instance is short, so a grammar-
    following generation ends well within its token budget."""
    kinds = ["string", "integer", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "none"], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 0, "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "ok", "tags", "size", "kind", "meta"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": names, "additionalProperties": False}


def test_random_json_schemas_always_validate_disaggregated_with_mtp(cluster, client) -> None:
    rng = random.Random(0)
    schemas = [{"type": "object", "properties": {"v": random_schema(rng)}, "required": ["v"],
                "additionalProperties": False} for _ in range(NUM_SCHEMAS)]

    def ask(index: int) -> tuple[dict, str]:
        schema = schemas[index]
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"Give JSON number {index}."}], max_tokens=200,
            temperature=0.0 if index % 2 else 0.8, seed=index,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        return schema, out.choices[0].message.content or ""

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(NUM_SCHEMAS)))
    for schema, text in answers:
        jsonschema.validate(json.loads(text), schema)
    reasons = {d.reason for _, d in cluster.orchestrator.recent_decisions}
    assert reasons <= {"prefill_least_cost", "prefill_cached_prefix"}  # every first token came from the prefill worker
    assert sum(w.engine.spec.metrics.num_accepted_tokens for w in cluster.decode) > 0  # MTP drafts were accepted


def test_json_object_choice_and_regex_streamed_and_not(client) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="data = ", max_tokens=200, temperature=0.0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out.choices[0].text), dict)
    chosen = client.completions.create(model=MODEL_NAME, prompt="pick: ", max_tokens=10, temperature=1.0, n=3, seed=2,
                                       extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert all(c.text in ("alpha", "beta", "gamma") for c in chosen.choices)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt="phone: ", max_tokens=20, temperature=0.0, stream=True,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"}) if c.choices)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "[unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "nonsense-type"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_bad_grammars_are_400_naming_the_field(cluster, extra, param) -> None:
    response = httpx.post(cluster.base_url + "/v1/completions",
                          json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"], error
