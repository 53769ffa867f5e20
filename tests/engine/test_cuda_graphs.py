"""Decode steps replayed from CUDA graphs give the same greedy tokens as eager decode steps (GPU only)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import mamba2, nemotron_h

from hybridserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + (i * 11 + j) % 100 for j in range(n)] for i, n in enumerate((4, 33, 9, 70, 2))]


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_graph_decode_equals_eager(family):
    model_dir = nemotron_h("M*-M")[0] if family == "nemotron_h" else mamba2()[0]
    eager_llm = LLM(model_dir, device="cuda", dtype="float32", cuda_graphs=False)
    assert eager_llm.engine.runner.decode_graphs is None
    eager = eager_llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    llm = LLM(model_dir, device="cuda", dtype="float32")  # graphs are on by default on CUDA
    assert llm.engine.runner.decode_graphs is not None
    graphed = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert llm.engine.graph_stats()["graph_decode_steps"] > 0, "no decode step went through a graph"
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def test_mixed_steps_replay_the_decode_rows_and_match_eager():
    """A prefill chunk beside decode rows: the decode rows replay their graph, the prefill runs eagerly."""
    model_dir = nemotron_h("M*-M")[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = LLM(model_dir, device="cuda", dtype="float32", cuda_graphs=False, prefill_chunk_size=8)
    expected = [o.token_ids for o in eager.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    for caching in (False, True):
        llm = LLM(model_dir, device="cuda", dtype="float32", prefill_chunk_size=8, enable_prefix_caching=caching)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert llm.engine.graph_stats()["split_mixed_steps"] > 0
        assert got == expected
