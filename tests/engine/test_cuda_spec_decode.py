"""Speculative decoding on CUDA (Triton verify kernels: multi-token update with per-token states, replay,
conv update over T tokens with a wide window, paged attention with the drafter's masked slot 0): fp32 greedy
output equals the CPU's plain greedy output, for MTP and n-gram drafts, oracle drafts included."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import nemotron_h_mtp, random_prompts

from hybridserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
OPTIONS = dict(max_model_len=160, state_block=16, page_size=8, max_num_seqs=4)


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
@pytest.mark.parametrize("method", ["mtp", "ngram"])
@pytest.mark.parametrize("oracle", [False, True])
def test_cuda_spec_greedy_equals_cpu_plain(method: str, rollback: str, oracle: bool) -> None:
    model_dir, _ = nemotron_h_mtp()
    prompts = random_prompts([5, 17, 30, 9], 128, seed=21)
    expected = [o.token_ids for o in LLM(model_dir, **OPTIONS).generate(prompt_token_ids=prompts,
                                                                       sampling_params=GREEDY)]
    spec = {"method": method, "num_speculative_tokens": 3, "rollback": rollback}
    llm = LLM(model_dir, device="cuda", dtype="float32", speculative_config=spec, **OPTIONS)
    if oracle:
        truth = {tuple(p): p + e for p, e in zip(prompts, expected)}
        rng = random.Random(0)

        def draft(request) -> list[int]:
            full = truth[tuple(request.prompt_token_ids)]
            return [t if rng.random() < 0.7 else (t + 1) % 128 for t in full[request.num_tokens :][:3]]

        llm.engine.spec.set_drafter(draft)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in got] == expected
    if oracle:
        assert llm.engine.spec.metrics.acceptance_length > 1.5
    assert llm.engine.graph_stats()["graph_decode_steps"] > 0  # verify steps replayed their CUDA graph
    llm.engine.pool.check()


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_cuda_spec_eager_verify_equals_graphed(rollback: str) -> None:
    """Verify steps without CUDA graphs (cuda_graphs=False) give the graphed engine's tokens, MTP drafts."""
    model_dir, _ = nemotron_h_mtp()
    prompts = random_prompts([5, 17, 30, 9], 128, seed=22)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "rollback": rollback}
    outs = {}
    for graphs in (False, True):
        llm = LLM(model_dir, device="cuda", dtype="float32", speculative_config=spec, cuda_graphs=graphs, **OPTIONS)
        outs[graphs] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
        assert (llm.engine.graph_stats()["graph_decode_steps"] > 0) == graphs
    assert outs[True] == outs[False]


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_cuda_spec_mixed_steps_replay_the_verify_rows(rollback: str) -> None:
    """Prefill chunks of 8 tokens keep prompts prefilling beside verify rows: those steps replay the verify rows'
    graph and run only the prefill eagerly (split mixed steps); greedy tokens equal the CPU's plain greedy output."""
    model_dir, _ = nemotron_h_mtp()
    prompts = random_prompts([5, 17, 30, 9], 128, seed=23)
    options = dict(OPTIONS, prefill_chunk_size=8)
    expected = [o.token_ids for o in LLM(model_dir, **options).generate(prompt_token_ids=prompts,
                                                                        sampling_params=GREEDY)]
    spec = {"method": "mtp", "num_speculative_tokens": 3, "rollback": rollback}
    llm = LLM(model_dir, device="cuda", dtype="float32", speculative_config=spec, **options)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert llm.engine.graph_stats()["split_mixed_steps"] > 0
    assert got == expected
    llm.engine.pool.check()

