"""Chunked prefill at any chunk size, mixed with decodes, gives the tokens of one pass."""

from __future__ import annotations

import pytest
import torch
from checkpoints import mamba2, nemotron_h, nemotron_h_mtp, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.common.model_config import ModelConfig
from hybridserve.statepool import CacheLayout

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _generate(model_dir, prompts, **engine_kwargs):
    outs = LLM(model_dir, **engine_kwargs).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("factory", [lambda: nemotron_h("M*-M*"), lambda: mamba2()], ids=["nemotron_h", "mamba2"])
def test_chunk_sizes_give_one_pass_tokens(factory) -> None:
    model_dir, _ = factory()
    prompts = random_prompts([3, 17, 40, 9], vocab=128, seed=5)
    one_pass = _generate(model_dir, prompts, prefill_chunk_size=512)
    for chunk in (1, 3, 8, 13):
        assert _generate(model_dir, prompts, prefill_chunk_size=chunk) == one_pass, f"chunk {chunk}"


def test_one_slot_and_small_pages_queue_and_match() -> None:
    model_dir, _ = nemotron_h("*M-M")
    prompts = random_prompts([12, 30, 5], vocab=128, seed=6)
    reference = _generate(model_dir, prompts)
    assert _generate(model_dir, prompts, max_num_seqs=1, page_size=4, prefill_chunk_size=7) == reference


def test_preemption_under_page_pressure_keeps_tokens() -> None:
    model_dir, _ = nemotron_h("M*")
    prompts = random_prompts([20, 20, 20, 20], vocab=128, seed=7)
    reference = _generate(model_dir, prompts)
    config = ModelConfig.from_dir(model_dir)
    # a budget of 4 slots and 16 pages of 4 tokens: four requests of 28 tokens cannot all hold their KV
    budget = 4 * CacheLayout.bytes_per_slot(config, 3, torch.float32, torch.float32)
    budget += 16 * CacheLayout.bytes_per_page(config, 4, torch.float32)
    llm = LLM(model_dir, page_size=4, max_num_seqs=4, max_model_len=40, cpu_memory_gb=budget / 2**30, num_kv_pages=16)
    assert llm.engine.cache.layout.num_pages == 16
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.pages.num_free == 16
    assert llm.engine.pool.slots.num_free == 4


class SplitCheck:
    """Stands in for the runner's model: every mixed batch is run whole and, from the same cache contents, as
    its decode half then its prefill half (`ForwardBatch.decode_half` / `prefill_half`, what a CUDA-graph engine does); the
    hidden states and every cache tensor must agree."""

    def __init__(self, model) -> None:
        self.model = model
        self.checked = 0
        self.verify_rows = 0

    def __call__(self, input_ids, batch, cache):
        if not 0 < batch.num_decode < batch.num_seqs:
            return self.model(input_ids, batch, cache)
        tensors = [cache.k_pages, cache.v_pages, cache.conv_states, cache.ssm_states]
        if batch.spec_rollback == "replay":  # the verify rows' replay inputs too
            tensors += [t for layer in cache._replay for t in (layer.prev_x, layer.prev_B, layer.prev_dt,
                                                               layer.prev_cum, layer.buf)]
        before = [t.clone() for t in tensors]
        whole = self.model(input_ids, batch, cache)
        after = [t.clone() for t in tensors]
        states = {layer: s.clone() for layer, s in batch.intermediate_states.items()}
        batch.intermediate_states.clear()
        for t, saved in zip(tensors, before):
            t.copy_(saved)
        decodes, prefills = batch.decode_half(), batch.prefill_half()
        rows = batch.num_decode * batch.decode_len
        parts = torch.cat([self.model(input_ids[:rows], decodes, cache),
                           self.model(input_ids[rows:], prefills, cache)])
        torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
        for t, expected in zip(tensors, after):
            torch.testing.assert_close(t, expected, rtol=1e-5, atol=1e-5)
        assert batch.intermediate_states.keys() == states.keys()  # the decode half filled the whole batch's dict
        for layer, expected in states.items():
            torch.testing.assert_close(batch.intermediate_states[layer], expected, rtol=1e-5, atol=1e-5)
        self.checked += 1
        self.verify_rows += batch.num_decode if batch.decode_len > 1 else 0
        return parts

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("caching", [False, True], ids=["cache_off", "cache_on"])
def test_mixed_step_split_into_decodes_and_prefill_matches_whole(caching) -> None:
    model_dir, _ = nemotron_h("M*-M*")
    prompts = random_prompts([3, 40, 9, 33], vocab=128, seed=8)
    reference = _generate(model_dir, prompts, prefill_chunk_size=7)
    llm = LLM(model_dir, prefill_chunk_size=7, enable_prefix_caching=caching, state_block=16 if caching else None)
    check = SplitCheck(llm.engine.runner.model)
    llm.engine.runner.model = check
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert check.checked > 0, "no mixed step was scheduled"
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_mixed_verify_step_split_into_verify_rows_and_prefill_matches_whole(rollback: str) -> None:
    """Speculating, a step's verify rows (T tokens each) beside prefill chunks split as a CUDA-graph engine splits
    them: hidden states, every cache tensor, the replay inputs and the per-token states equal the whole step's."""
    model_dir, _ = nemotron_h_mtp()
    prompts = random_prompts([3, 40, 9, 33], vocab=128, seed=8)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "rollback": rollback}
    reference = _generate(model_dir, prompts, prefill_chunk_size=7)
    llm = LLM(model_dir, prefill_chunk_size=7, speculative_config=spec, enable_prefix_caching=True, state_block=16)
    check = SplitCheck(llm.engine.runner.model)
    llm.engine.runner.model = check
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert check.verify_rows > 0, "no verify row was scheduled beside a prefill chunk"
    assert [o.token_ids for o in outs] == reference


def test_batch_halves_refuse_a_batch_that_does_not_split() -> None:
    from hybridserve.engine.model_runner import PlacedRow, place_rows

    batch, _ = place_rows([PlacedRow([0], 3, 1, 0), PlacedRow([1], 0, 4, 1)], 1, 16, torch.device("cpu"))
    decodes, prefills = batch.decode_half(), batch.prefill_half()
    assert decodes.query_lens == (1,) and prefills.query_lens == (4,)
    assert prefills.cu_seqlens.tolist() == [0, 4] and prefills.slot_mapping.tolist() == [16, 17, 18, 19]
    only_decodes, _ = place_rows([PlacedRow([0], 3, 1, 0)], 1, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="splits into decode rows and prefill rows"):
        only_decodes.prefill_half()


class StepRecorder:
    """Stands in for the runner's model: keeps every forward's batch shape and hidden states."""

    def __init__(self, model) -> None:
        self.model = model
        self.steps: list[tuple[int, tuple[int, ...], torch.Tensor]] = []

    def __call__(self, input_ids, batch, cache):
        hidden = self.model(input_ids, batch, cache)
        self.steps.append((batch.num_decode, batch.query_lens, hidden.clone()))
        return hidden

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("caching", [False, True], ids=["cache_off", "cache_on"])
def test_folded_decode_rows_match_decode_rows(caching) -> None:
    """Mixed steps with their decode rows folded into the prefill forward as one-token chunks: every step's
    hidden states equal those of the same step with recurrent decode rows, and so do the tokens. With the cache
    on, decode tokens land on checkpoint boundaries (state_block 16) beside prefill chunks that keep theirs."""
    model_dir, _ = nemotron_h("M*-M*")
    prompts = random_prompts([5, 60, 40, 9], vocab=128, seed=9)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    runs = {}
    hits: dict[bool, tuple[list[list[int]], int]] = {}
    crossings: list[int] = []
    for fold in (False, True):
        llm = LLM(model_dir, prefill_chunk_size=7, max_num_seqs=3, enable_prefix_caching=caching,
                  state_block=16 if caching else None, fold_decode_rows=fold)
        recorder = StepRecorder(llm.engine.runner.model)
        llm.engine.runner.model = recorder
        if fold and caching:
            runner = llm.engine.runner
            plain = runner._fold_boundaries

            def spy(decodes, slots, plain=plain):
                found = plain(decodes, slots)
                crossings.append(0 if found is None or slots is None else len(found) - len(slots))
                return found

            runner._fold_boundaries = spy
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        runs[fold] = ([o.token_ids for o in outs], recorder.steps)
        if caching:  # the checkpoints the folded steps kept serve hits: a misfiled one would change the tokens
            again = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            hits[fold] = ([o.token_ids for o in again], sum(o.num_cached_tokens for o in again))
    (tokens, steps), (folded_tokens, folded_steps) = runs[False], runs[True]
    assert folded_tokens == tokens
    if caching:
        assert hits[True] == hits[False] and hits[True][0] == tokens
        assert hits[True][1] > 0, "the second pass hit no checkpoint"
    assert len(folded_steps) == len(steps)
    folded = 0
    for (nd, lens, hidden), (fold_nd, fold_lens, fold_hidden) in zip(steps, folded_steps):
        assert fold_lens == lens
        if 0 < nd < len(lens):
            assert fold_nd == 0  # the model saw a prefill
            folded += 1
        torch.testing.assert_close(fold_hidden, hidden, rtol=1e-4, atol=1e-4)
    assert folded > 0, "no mixed step was scheduled"
    if caching:
        assert any(crossings), "no folded decode row crossed a kept checkpoint boundary"


def test_fold_decode_rows_config() -> None:
    from hybridserve.engine.config import EngineConfig

    assert not EngineConfig().fold_decode_rows  # off by default (ties the split on the GPU)
    with pytest.raises(ValueError, match="fold_decode_rows must be a bool"):
        EngineConfig(fold_decode_rows="yes")  # type: ignore[arg-type]
