"""Sampling fields through the live server with the official client: logit_bias, min_tokens, the penalties
(equal to the offline engine), n with seed, best_of (the n candidates of highest cumulative logprob),
max_completion_tokens and user; bad values get a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from router_cluster import MODEL_NAME

from hybridserve import LLM, SamplingParams

PROMPT = "Sampling fields, one by one."


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_logit_bias_and_min_tokens(client) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={"7": 100}, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert _ids(out.choices[0]) == [7] * 4
    held = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={"7": 100},
                                     extra_body={"return_token_ids": True, "min_tokens": 3, "stop_token_ids": [7]})
    ids = _ids(held.choices[0])
    assert 7 not in ids[:3] and ids[3] == 7 and held.choices[0].finish_reason == "stop"


def test_penalties_equal_the_offline_engine(cluster, client, model_dir) -> None:
    prompt_ids = httpx.post(cluster.base_url + "/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT}).json()["tokens"]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, presence_penalty=1.0,
                                    frequency_penalty=0.5, extra_body={"repetition_penalty": 1.25,
                                                                       "no_repeat_ngram_size": 2,
                                                                       "return_token_ids": True, "ignore_eos": True})
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, presence_penalty=1.0,
                            frequency_penalty=0.5, repetition_penalty=1.25, no_repeat_ngram_size=2)
    offline = LLM(str(model_dir)).generate(prompt_token_ids=[prompt_ids], sampling_params=params)[0]
    assert _ids(out.choices[0]) == offline.token_ids


def test_n_with_seed_and_best_of(client) -> None:
    def run(**kwargs):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=5,
                                         logprobs=0, extra_body={"ignore_eos": True}, **kwargs)

    three, again = run(n=3), run(n=3)
    assert [c.text for c in three.choices] == [c.text for c in again.choices]
    assert len({c.text for c in three.choices}) > 1
    best = run(n=1, best_of=3)
    assert len(best.choices) == 1 and best.usage.completion_tokens == 15
    winner = max(three.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert best.choices[0].text == winner.text


def test_max_completion_tokens_and_user(client) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                         max_completion_tokens=3, user="user-1", temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"999": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
    ({"no_repeat_ngram_size": 65}, "no_repeat_ngram_size"),
    ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
])
def test_bad_sampling_fields_name_the_field(cluster, body, param) -> None:
    response = httpx.post(cluster.base_url + "/v1/completions",
                          json={"model": MODEL_NAME, "prompt": "hi", **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"], error
