"""Structured outputs over a disaggregated server with MTP on (the demo model): random JSON schemas through
response_format always parse and validate, json_object parses, guided_choice / guided_regex hold, streamed and
not; the first token comes from the prefill worker under the same grammar. Bad grammars get a 400."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from router_cluster import MODEL_NAME, Cluster
from structured_schemas import ENGINE_OPTIONS, random_schemas, run_schemas

from hybridserve.engine.config import EngineConfig
from hybridserve.models.default_model import default_model_dir

NUM_SCHEMAS = 24  # bench/serving/structured_schemas.py runs 100 (bench/results/cpu/structured_output/)
ENGINE = EngineConfig(**ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(default_model_dir(), num_prefill=1, num_decode=1, engine=ENGINE)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_random_json_schemas_always_validate_disaggregated_with_mtp(cluster, client) -> None:
    summary = run_schemas(cluster, client, MODEL_NAME, random_schemas(NUM_SCHEMAS))
    assert summary["failures"] == []
    assert set(summary["routing_reasons"]) <= {"prefill_least_cost", "prefill_cached_prefix"}  # first tokens from P
    assert summary["mtp_accepted_tokens"] > 0  # MTP drafts were accepted


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
