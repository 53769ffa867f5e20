"""Logprobs through the live server with the official client: completions `logprobs` (+ `echo`, lm-eval's
loglikelihood request) and chat `logprobs` / `top_logprobs`, streamed and not, equal to the offline engine's
prompt logits; such requests prefill on their decode worker (the prefill worker's first token carries none)."""

from __future__ import annotations

import httpx
import pytest
import torch
from router_cluster import MODEL_NAME

from hybridserve import LLM

PROMPT = "Logprobs, echo and top alternatives."


@pytest.fixture(scope="module")
def scores(model_dir):
    llm = LLM(str(model_dir))

    def run(token_ids: list[int]) -> torch.Tensor:
        """[len - 1] raw logprob of each token after the first, from one scoring pass."""
        logprobs = torch.log_softmax(llm.prompt_logits(token_ids).float(), dim=-1)
        return logprobs[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])]

    return run


def _prompt_ids(cluster) -> list[int]:
    return httpx.post(cluster.base_url + "/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT}).json()["tokens"]


def test_echo_logprobs_equal_the_offline_prompt_logits(cluster, client, scores) -> None:
    ids = _prompt_ids(cluster)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                    logprobs=1)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(PROMPT)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = scores(ids + [0])[: len(ids) - 1]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1 : len(ids)]), expected, atol=1e-4, rtol=0)
    assert "".join(lp.tokens[: len(ids)]) == PROMPT and lp.text_offset[1] == len(lp.tokens[0])
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert cluster.orchestrator.recent_decisions[-1][1].reason == "needs_local"


def test_completion_logprobs_streamed_and_not_agree_with_offline(cluster, client, scores) -> None:
    ids = _prompt_ids(cluster)
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = whole.choices[0]
    generated = choice.model_extra["token_ids"]
    expected = scores(ids + generated)[len(ids) - 1 :]
    torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs), expected, atol=1e-4, rtol=0)
    # 2 entries, fewer when two tokens decode to the same string (bytes of a partial UTF-8 character)
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    streamed: list[float] = []
    offsets: list[int] = []
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.token_logprobs)
            offsets.extend(chunk.choices[0].logprobs.text_offset)
    assert streamed == pytest.approx(choice.logprobs.token_logprobs, abs=1e-6)
    assert offsets == choice.logprobs.text_offset


def test_chat_logprobs_and_top_logprobs(client) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert all(c.top_logprobs[0].token == c.token for c in content)  # greedy picks the most likely token
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_logprobs_requests_name_the_field(cluster, body, param) -> None:
    response = httpx.post(cluster.base_url + "/v1/chat/completions", json={"model": MODEL_NAME, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"]
