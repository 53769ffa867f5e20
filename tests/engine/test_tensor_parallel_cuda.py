"""Tensor parallelism on 2 GPUs (NCCL): decode steps replayed from CUDA graphs that hold the NCCL all-reduces
give the eager TP=2 and the TP=1 greedy tokens, for a hybrid model and a MoE model (GPU only: 2 devices)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import nemotron_h, nemotron_h_moe, random_prompts

from hybridserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("moe", [False, True], ids=["hybrid", "moe"])
def test_tp2_graph_decode_equals_eager_and_tp1(moe: bool) -> None:
    model_dir = nemotron_h_moe("ME*E")[0] if moe else nemotron_h("M*-M")[0]
    prompts = random_prompts([4, 33, 9, 70], vocab=128, seed=21)
    options = dict(device="cuda", dtype="float32", max_model_len=256)
    expected = [o.token_ids for o in LLM(model_dir, **options).generate(prompt_token_ids=prompts,
                                                                        sampling_params=GREEDY)]
    eager = LLM(model_dir, tensor_parallel_size=2, cuda_graphs=False, **options)
    try:
        assert [o.token_ids for o in eager.generate(prompt_token_ids=prompts, sampling_params=GREEDY)] == expected
    finally:
        eager.engine.close()
    llm = LLM(model_dir, tensor_parallel_size=2, **options)
    try:
        assert llm.engine.runner.decode_graphs is not None  # rank 0 replays, the follower too
        assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)] == expected
        assert llm.engine.graph_stats()["graph_decode_steps"] > 0, "no TP decode step went through a graph"
    finally:
        llm.engine.close()
