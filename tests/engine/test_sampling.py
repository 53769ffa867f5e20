"""Sampling controls, stop rules, and per-request determinism independent of the batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from checkpoints import nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams


def _llm(**kwargs) -> LLM:
    model_dir, _ = nemotron_h("M*-M")
    return LLM(model_dir, **kwargs)


def test_seeded_samples_do_not_depend_on_batch_composition() -> None:
    llm = _llm()
    target = random_prompts([9], vocab=128, seed=20)[0]
    others = random_prompts([3, 17, 25], vocab=128, seed=21)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[target], sampling_params=params)[0].token_ids
    mixed = llm.generate(
        prompt_token_ids=[*others, target],
        sampling_params=[SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)] * 3 + [params],
    )[-1].token_ids
    assert alone == mixed


def test_engine_seed_makes_unseeded_runs_repeatable() -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    prompts = random_prompts([4, 6], vocab=128, seed=22)
    first = [o.token_ids for o in _llm(seed=7).generate(prompt_token_ids=prompts, sampling_params=params)]
    again = [o.token_ids for o in _llm(seed=7).generate(prompt_token_ids=prompts, sampling_params=params)]
    assert first == again


def test_admission_draws_seeds_without_a_torch_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch op releases the GIL; on a worker's engine loop that cost each admission a trip back for it. The
    seeds of unseeded requests come from Python's generator: different engine seeds give different seeds."""
    llm, other = _llm(seed=7), _llm(seed=8)
    monkeypatch.setattr(torch, "randint", lambda *a, **k: pytest.fail("torch.randint on admission"))
    params = SamplingParams(max_tokens=2, temperature=1.0)
    seeds = [llm.engine._requests[llm.engine.add_request([5, 6], params)].generator.initial_seed() for _ in range(3)]
    assert len(set(seeds)) == 3
    assert other.engine._requests[other.engine.add_request([5, 6], params)].generator.initial_seed() != seeds[0]


def test_top_k_one_is_greedy() -> None:
    llm = _llm()
    prompt = random_prompts([7], vocab=128, seed=23)
    greedy = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    top1_params = SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True)
    top1 = llm.generate(prompt_token_ids=prompt, sampling_params=top1_params)
    assert greedy[0].token_ids == top1[0].token_ids


def test_top_p_keeps_only_the_nucleus() -> None:
    llm = _llm()
    prompt = random_prompts([5], vocab=128, seed=24)[0]
    greedy = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1, temperature=0.0))[0]
    tiny_p = SamplingParams(max_tokens=1, temperature=1.0, top_p=1e-6, seed=3)
    assert llm.generate(prompt_token_ids=[prompt], sampling_params=tiny_p)[0].token_ids == greedy.token_ids


def test_stop_token_and_eos() -> None:
    llm = _llm()
    prompt = random_prompts([6], vocab=128, seed=25)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    free = llm.generate(prompt_token_ids=prompt, sampling_params=greedy)[0]
    stop_at = free.token_ids[2]
    stopped = llm.generate(
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True),
    )[0]
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"
    # an EOS token of the model stops unless ignore_eos
    eos_llm = _llm()
    eos_llm.engine.model_config = dataclasses.replace(eos_llm.engine.model_config, eos_token_ids=(stop_at,))
    eos_llm.engine.scheduler.eos_token_ids = frozenset({stop_at})  # the scheduler applies the stop rules
    eos_out = eos_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert eos_out.token_ids == stopped.token_ids and eos_out.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 6
