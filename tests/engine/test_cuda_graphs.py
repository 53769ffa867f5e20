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
    from hybridserve.engine.cuda_graphs import GraphedModel

    model_dir = nemotron_h("M*-M")[0] if family == "nemotron_h" else mamba2()[0]
    eager_llm = LLM(model_dir, device="cuda", dtype="float32", cuda_graphs=False)
    assert not isinstance(eager_llm.engine.runner.model, GraphedModel)
    eager = eager_llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    llm = LLM(model_dir, device="cuda", dtype="float32")  # graphs are on by default on CUDA
    assert isinstance(llm.engine.runner.model, GraphedModel)
    graphs = llm.engine.runner.model.graphs
    replays = []
    original = graphs.run

    def counting_run(input_ids, batch):
        out = original(input_ids, batch)
        replays.append(out is not None)
        return out

    graphs.run = counting_run  # type: ignore[method-assign]
    graphed = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert any(replays), "no decode step went through a graph"
    assert all(len(pieces) == 1 for pieces, _, _ in graphs.graphs.values())  # one graph per step by default
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def test_mixed_steps_replay_the_decode_rows_and_match_eager():
    """A prefill chunk beside decode rows: the decode rows replay their graph, the prefill runs eagerly."""
    model_dir = nemotron_h("M*-M")[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = LLM(model_dir, device="cuda", dtype="float32", cuda_graphs=False, prefill_chunk_size=8)
    expected = [o.token_ids for o in eager.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    for caching in (False, True):
        llm = LLM(model_dir, device="cuda", dtype="float32", prefill_chunk_size=8, enable_prefix_caching=caching,
                  fold_decode_rows=False)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        assert llm.engine.graph_stats()["split_mixed_steps"] > 0
        assert got == expected


def test_mixed_steps_fold_the_decode_rows_and_match_eager():
    """fold_decode_rows: decode rows beside a prefill chunk run as one-token chunks of the eager prefill."""
    model_dir = nemotron_h("M*-M")[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = LLM(model_dir, device="cuda", dtype="float32", cuda_graphs=False, prefill_chunk_size=8,
                fold_decode_rows=False)
    expected = [o.token_ids for o in eager.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    for caching in (False, True):
        llm = LLM(model_dir, device="cuda", dtype="float32", prefill_chunk_size=8, enable_prefix_caching=caching,
                  state_block=16 if caching else None, fold_decode_rows=True)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
        stats = llm.engine.graph_stats()
        assert stats["folded_mixed_steps"] > 0 and stats["split_mixed_steps"] == 0
        assert got == expected


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_graphs_launched_in_pieces_equal_eager(monkeypatch, family):
    """HYBRIDSERVE_STAGED_GRAPHS=1: each step's graph cut after layer 0, its pieces replayed in order."""
    monkeypatch.setenv("HYBRIDSERVE_STAGED_GRAPHS", "1")
    model_dir = nemotron_h("M*-M")[0] if family == "nemotron_h" else mamba2()[0]
    eager = LLM(model_dir, device="cuda", dtype="float32", cuda_graphs=False).generate(
        prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    llm = LLM(model_dir, device="cuda", dtype="float32")
    assert all(len(pieces) == 2 for pieces, _, _ in llm.engine.runner.model.graphs.graphs.values())
    graphed = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
