"""Two prefill and two decode workers: shared prefixes go where the Mamba checkpoint is; a follow-up turn
goes to the decode worker holding the previous turn and is prefilled there; the index matches the workers."""

from __future__ import annotations

import time

import openai
import pytest
from checkpoints import random_prompts
from router_cluster import MODEL_NAME, Cluster


@pytest.fixture(scope="module")
def four(model_dir):
    c = Cluster(model_dir, num_prefill=2, num_decode=2)
    yield c
    c.stop()


def _complete(cluster: Cluster, prompt: list[int], max_tokens: int, request_id: str):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True},
                                    extra_headers={"x-request-id": request_id})
    internal = out.id.removeprefix("cmpl-")  # the client's x-request-id is only a label
    decision = dict(cluster.router.orchestrator.recent_decisions)[f"{internal}-0"]
    return out, decision


def _wait_for_checkpoint(cluster: Cluster, worker: str, prompt: list[int], tokens: int) -> None:
    from hybridserve.router.policy import prompt_hashes

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        hit = cluster.router.orchestrator.index.match(prompt_hashes(prompt, 16)).get(worker)
        if hit is not None and hit.checkpoint_tokens >= tokens:
            return
        time.sleep(0.05)
    raise AssertionError(f"the index never saw {worker}'s checkpoint at {tokens}")


def test_shared_prefix_goes_where_the_checkpoint_is(four) -> None:
    system = random_prompts([64], vocab=320, seed=70)[0]
    tails = random_prompts([20, 24, 18], vocab=320, seed=71)
    first, d0 = _complete(four, system + tails[0], 4, "shared-0")
    assert not d0.local and d0.reason == "prefill_least_cost"
    holder = d0.prefill.address
    _wait_for_checkpoint(four, holder, system + tails[1], 64)
    for i, tail in enumerate(tails[1:], start=1):
        out, d = _complete(four, system + tail, 4, f"shared-{i}")
        assert d.prefill is not None and d.prefill.address == holder and d.reason == "prefill_cached_prefix"
        assert d.predicted_cached_tokens == 64
        assert out.usage.prompt_tokens_details.cached_tokens == 64  # the worker's true hit agrees


def test_follow_up_turn_prefills_locally_on_the_decode_worker(four) -> None:
    turn1 = random_prompts([70], vocab=320, seed=72)[0]
    out1, d1 = _complete(four, turn1, 40, "chat-turn-1")
    assert not d1.local
    answer = out1.choices[0].model_extra["token_ids"]
    turn2 = turn1 + answer + random_prompts([10], vocab=320, seed=73)[0]
    _wait_for_checkpoint(four, d1.decode.address, turn2, 96)
    out2, d2 = _complete(four, turn2, 4, "chat-turn-2")
    assert d2.local and d2.decode is d1.decode and d2.reason == "decode_prefix_hit"
    assert d2.predicted_cached_tokens == 96 and out2.usage.prompt_tokens_details.cached_tokens == 96
    count = four.router.metrics.registry.get_sample_value(
        "hybridserve_router_routing_decisions_total", {"mode": "local", "reason": "decode_prefix_hit"})
    assert count >= 1


def test_unavailable_prefill_is_retried_elsewhere_and_its_breaker_opens(four) -> None:
    orchestrator = four.router.orchestrator
    decode = [w.address for w in four.decode]
    orchestrator.update_workers(["127.0.0.1:9"], decode)  # answers nothing
    registry = four.router.metrics.registry
    try:
        prompt = random_prompts([40], vocab=320, seed=74)[0]
        out, d = _complete(four, prompt, 3, "retry-0")  # the recorded decision is the last attempt's
        assert out.usage.completion_tokens == 3 and d.local and d.reason == "no_prefill_worker"
        assert registry.get_sample_value("hybridserve_router_retries_total", {"stage": "prefill"}) >= 1
        dead = orchestrator.workers.snapshot()[0][0]
        deadline = time.monotonic() + 10
        while dead.breaker.available() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not dead.breaker.available()  # failed health checks opened it: no more attempts on it
        _, d = _complete(four, random_prompts([40], vocab=320, seed=75)[0], 2, "retry-1")
        assert d.reason == "no_prefill_worker"
    finally:
        orchestrator.update_workers([w.address for w in four.prefill], decode)
