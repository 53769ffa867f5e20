"""Prefill steps replayed from CUDA graphs (engine/prefill_graphs.py) give the eager engine's greedy tokens: fresh and
resumed prompts, several per step, prefix-cache checkpoints written from inside the graph (GPU only)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import mamba2, nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    system, *tails = random_prompts([40, 3, 21, 57, 9, 30, 130], vocab=128, seed=12)
    return [system + t for t in tails] + [tails[2]]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
@pytest.mark.parametrize("chunk", [50, None], ids=["chunk50", "chunk_default"])
def test_graph_prefill_equals_eager(family: str, chunk: int | None) -> None:
    model_dir = nemotron_h("M*-M*")[0] if family == "nemotron_h" else mamba2()[0]
    options = dict(device="cuda", dtype="float32", prefill_chunk_size=chunk, state_block=16, page_size=8,
                   max_model_len=512)
    prompts = _prompts()
    eager = LLM(model_dir, cuda_graphs=False, **options)
    warm_eager = _tokens(eager, prompts[:1])
    expected = _tokens(eager, prompts)  # the second call hits the cached system prompt
    llm = LLM(model_dir, **options)
    assert llm.engine.runner.prefill_graphs is not None
    assert _tokens(llm, prompts[:1]) == warm_eager
    assert _tokens(llm, prompts) == expected
    stats = llm.engine.graph_stats()
    assert stats["graph_prefill_forwards"] > 0
    assert llm.engine.pool.num_hits > 0  # resumed prompts went through the graph too


def test_prefill_graphs_off_and_oversized_prefills_run_eagerly() -> None:
    model_dir = nemotron_h("M*-M*")[0]
    prompts = [p[:130] for p in _prompts()]
    expected = _tokens(LLM(model_dir, device="cuda", dtype="float32", cuda_graphs=False), prompts)
    off = LLM(model_dir, device="cuda", dtype="float32", prefill_cuda_graphs=False)
    assert off.engine.runner.prefill_graphs is None
    assert _tokens(off, prompts) == expected
    assert off.engine.graph_stats()["graph_prefill_forwards"] == 0
    # a prefill chunk past the largest bucket (1024) runs eagerly, tokens unchanged
    long_prompt = random_prompts([1500], vocab=128, seed=3)[0]
    options = dict(device="cuda", dtype="float32", max_model_len=2048, prefill_chunk_size=2048)
    long_expected = _tokens(LLM(model_dir, cuda_graphs=False, **options), [long_prompt] + prompts)
    mixed = LLM(model_dir, **options)
    assert _tokens(mixed, [long_prompt] + prompts) == long_expected
    stats = mixed.engine.graph_stats()
    assert stats["eager_prefill_forwards"] > 0 and stats["graph_prefill_forwards"] > 0


def test_bf16_prefill_graph_tokens_match_eager() -> None:
    model_dir = nemotron_h("M*-M*")[0]
    prompts = _prompts()
    eager = _tokens(LLM(model_dir, device="cuda", dtype="bfloat16", cuda_graphs=False), prompts)
    llm = LLM(model_dir, device="cuda", dtype="bfloat16")
    assert _tokens(llm, prompts) == eager
    assert llm.engine.graph_stats()["graph_prefill_forwards"] > 0
