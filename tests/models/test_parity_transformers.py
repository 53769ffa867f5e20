"""Logits and greedy tokens equal transformers' own NemotronH / Mamba2 on tiny random checkpoints (fp32)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_greedy, hf_logits, mamba2, nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams

RTOL, ATOL = 1e-4, 1e-5

NEMOTRON_CASES = {
    "mamba-first": dict(pattern="M*-M"),
    "attention-first": dict(pattern="*M-M*"),
    "one-group": dict(pattern="M-*M", n_groups=1),
    "four-groups-chunk5": dict(pattern="MM*-", n_groups=4, chunk_size=5),
    "moe": dict(
        pattern="M*EM",
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24,
        n_group=2,
        topk_group=1,
    ),
    "mlp-only-mamba": dict(pattern="M-M-"),
}


def _nemotron(case: str):
    kwargs = dict(NEMOTRON_CASES[case])
    return nemotron_h(kwargs.pop("pattern"), **kwargs)


@pytest.mark.parametrize("case", sorted(NEMOTRON_CASES))
def test_nemotron_h_logits_match_transformers(case: str) -> None:
    model_dir, hf = _nemotron(case)
    llm = LLM(model_dir, prefill_chunk_size=64)
    for prompt in random_prompts([1, 7, 8, 21], vocab=128, seed=1):
        torch.testing.assert_close(llm.prompt_logits(prompt), hf_logits(hf, prompt), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("tied", [False, True])
def test_mamba2_logits_match_transformers(tied: bool) -> None:
    model_dir, hf = mamba2(tie_word_embeddings=tied)
    llm = LLM(model_dir)
    for prompt in random_prompts([1, 9, 30], vocab=128, seed=2):
        torch.testing.assert_close(llm.prompt_logits(prompt), hf_logits(hf, prompt), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", ["mamba-first", "attention-first", "four-groups-chunk5", "moe"])
def test_nemotron_h_greedy_batch_matches_transformers(case: str) -> None:
    model_dir, hf = _nemotron(case)
    prompts = random_prompts([1, 5, 13, 26], vocab=128, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = LLM(model_dir, prefill_chunk_size=16).generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
        assert out.finish_reason == "length"


def test_mamba2_greedy_batch_matches_transformers() -> None:
    model_dir, hf = mamba2()
    prompts = random_prompts([2, 11, 19], vocab=128, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = LLM(model_dir).generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 8)
