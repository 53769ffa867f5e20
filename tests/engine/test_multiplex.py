"""PD multiplexing on CPU with the fake partition: the prefill lane's forward is held in flight for a few decode
iterations, so prompts arrive, prefill and pass to the decode lane while other requests decode; greedy tokens equal
the co-located engine's, and the pool passes its check after every test."""

from __future__ import annotations

import logging

import pytest
import torch
from checkpoints import nemotron_h, nemotron_h_mtp, random_prompts
from multiplex_case import GREEDY, LENGTHS, check_idle, drive, engines, slow_lanes, staggered

from hybridserve import LLM, SamplingParams
from hybridserve.common.model_config import ModelConfig
from hybridserve.common.sampling_params import StructuredOutput
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.sm_partition import SmSplit
from hybridserve.engine.split_profile import profile_splits
from hybridserve.models.default_model import default_model_dir
from hybridserve.statepool import CacheLayout


@pytest.mark.parametrize(("delay", "whole_gpu"), [(0, False), (3, False), (0, True), (3, True)])
def test_greedy_tokens_equal_colocated_while_requests_arrive(delay: int, whole_gpu: bool) -> None:
    model_dir, _ = nemotron_h("M*-M*")
    prompts = random_prompts(LENGTHS, vocab=128, seed=11)
    colocated, engine, mux = engines(model_dir, delay, whole_gpu, prefill_chunk_size=16, enable_prefix_caching=False)
    expected = drive(colocated, staggered(prompts))
    launch, shared = engine.runner.launch, []
    colocated_step, whole_calls = engine.colocated_step, []

    def checked_launch(work, checkpoint_slots=None):  # a request is never in both lanes' forwards at once
        assert not (work.decodes and work.prefills), "a lane's batch mixes decodes and prefill chunks"
        if mux.in_flight is not None:
            shared.extend({id(c.request) for c in mux.in_flight.work.prefills} & {id(r) for r in work.decodes})
        return launch(work, checkpoint_slots)

    def checked_step(on_launched=None):  # a whole-GPU step: only with nothing in flight in a lane
        assert mux.whole and mux.in_flight is None
        whole_calls.append(mux.iteration)
        return colocated_step(on_launched)

    engine.runner.launch, engine.colocated_step = checked_launch, checked_step
    assert drive(engine, staggered(prompts)) == expected
    assert not shared
    # each lane's work by the SMs it ran on (a whole-GPU step's under all 132): every prompt token and every
    # generated token but the last is one row of one step (no prefix cache; a prompt's one last token left after
    # its chunks is a decode row)
    stats = mux.stats()
    rows = sum(stats["prefill_tokens_by_sms"].values()) + sum(stats["decode_rows_by_sms"].values())
    assert rows == sum(LENGTHS) + sum(len(tokens) - 1 for tokens in expected.values())
    lane_tokens = sum(v for k, v in stats["prefill_tokens_by_sms"].items() if k != 132)
    if whole_gpu:  # the first prompt prefills alone, the last ones decode alone: on the whole GPU; the rest in lanes
        assert 0 < stats["whole_gpu_steps"] <= len(whole_calls) and stats["prefill_tokens_by_sms"][132] > 0
        assert engine.async_steps is not None and engine.async_steps.num_async_steps > 0  # a step ahead of its tokens
        assert stats["decode_rows_by_sms"][132] > 0 and lane_tokens > 0
        assert 0 < mux.counters.handoffs < len(prompts)
    else:  # every prompt passed from the prefill lane to the decode lane
        assert mux.counters.handoffs == len(prompts) and not whole_calls
        assert lane_tokens == sum(stats["prefill_tokens_by_sms"].values())
    if delay:
        assert mux.counters.overlapped_steps > 0  # decode steps ran while a prefill forward was in flight
    check_idle(engine)
    check_idle(colocated)


@pytest.mark.parametrize("case", ["pinned", "controller", "prefix cache", "mtp"])
def test_a_prefill_completing_beside_a_decode_step_is_taken_and_the_next_launched(case: str) -> None:
    """While the decode step runs (a fence that reads as running for a few polls), each prefill forward that
    completes (its own fence pending for a poll first) is taken and the next one launched at once; the tokens stay
    the co-located engine's, with the prefix cache hit and with MTP drafts verified."""
    spec = {"method": "mtp", "num_speculative_tokens": 2} if case == "mtp" else None
    model_dir = nemotron_h_mtp()[0] if case == "mtp" else nemotron_h("M*-M*")[0]
    shared = random_prompts([40], vocab=128, seed=16)[0]
    prompts = random_prompts(LENGTHS, vocab=128, seed=15)
    if case == "prefix cache":
        prompts = [shared + p for p in prompts[:4]] + prompts[4:]
    colocated, engine, mux = engines(model_dir, 0, prefill_chunk_size=16, state_block=16, speculative_config=spec,
                                     enable_prefix_caching=case == "prefix cache")
    expected = drive(colocated, staggered(prompts, every=1))
    if case == "pinned":
        mux.pin(mux.controller.splits[1])
    slow_lanes(mux)
    assert drive(engine, staggered(prompts, every=1)) == expected
    assert mux.counters.handoffs == len(prompts)
    beside = mux.counters.prefills_beside_decode
    assert beside > 0 and mux.stats()["prefills_beside_decode"] == beside
    if case == "prefix cache":
        assert engine.pool.num_hits > 0
    check_idle(engine)


def test_prefix_cache_hits_while_multiplexed() -> None:
    model_dir, _ = nemotron_h("M*-M*")
    shared = random_prompts([48], vocab=128, seed=12)[0]
    tails = random_prompts([5, 19, 2, 30], vocab=128, seed=13)
    first = [(0, shared + tails[0], GREEDY)]
    later = [(40 + 3 * i, shared + tail, GREEDY) for i, tail in enumerate(tails[1:])]
    colocated, engine, mux = engines(model_dir, 2, prefill_chunk_size=16, state_block=16)
    expected = drive(colocated, first + later)
    assert drive(engine, first + later) == expected
    assert engine.pool.num_hits >= 3 and engine.pool.num_hit_tokens >= 3 * 48
    check_idle(engine)


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_mtp_speculative_decoding_while_multiplexed(rollback: str) -> None:
    model_dir, _ = nemotron_h_mtp()
    prompts = random_prompts([3, 40, 9, 33, 21], vocab=128, seed=14)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "rollback": rollback}
    colocated, engine, mux = engines(model_dir, 2, prefill_chunk_size=16, speculative_config=spec, state_block=16)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = drive(colocated, staggered(prompts, params, every=3))
    assert engine.spec is not None
    # the greedy answers as drafts (the MTP drafter still runs): verify rows accept several tokens per step
    engine.spec.set_drafter(lambda r: expected[r.request_id][len(r.output_token_ids) :])
    assert drive(engine, staggered(prompts, params, every=3)) == expected
    assert engine.spec.metrics.num_accepted_tokens > 0
    assert mux.counters.overlapped_steps > 0
    check_idle(engine)


def test_structured_output_while_multiplexed() -> None:
    model_dir = default_model_dir()
    colocated, engine, _ = engines(model_dir, 2, prefill_chunk_size=16)
    grammars = [StructuredOutput("regex", spec="[a-z]{3,8}@[a-z]{2,5}\\.com"),
                StructuredOutput("choice", choices=("red", "green", "blue")),
                StructuredOutput("json_object")]
    prompts = [colocated.encode(text) for text in ("An email address:", "A colour of the sky at noon",
                                                   "A JSON object describing a cat, with its name and age:")]
    arrivals = [(2 * i, prompt, SamplingParams(max_tokens=24, temperature=0.0, structured=grammar))
                for i, (prompt, grammar) in enumerate(zip(prompts, grammars))]
    expected = drive(colocated, arrivals)
    assert drive(engine, arrivals) == expected
    check_idle(engine)


def test_abort_during_prefill_in_flight_frees_the_slot_after_the_forward() -> None:
    model_dir, _ = nemotron_h("M*-M*")
    prompts = random_prompts([20, 40, 12], vocab=128, seed=15)
    colocated, engine, mux = engines(model_dir, 4, prefill_chunk_size=16, enable_prefix_caching=False)
    expected = drive(colocated, [(0, prompts[0], GREEDY), (0, prompts[2], GREEDY)])
    keep = engine.add_request(prompts[0], GREEDY)
    while not (engine.scheduler.running and engine.scheduler.running[0].is_decoding):
        engine.step()
    victim = engine.add_request(prompts[1], GREEDY)
    engine.step()  # the victim's first chunk is launched in the prefill lane and held in flight
    assert mux.in_flight is not None and [c.request.request_id for c in mux.in_flight.work.prefills] == [victim]
    slot = next(r for r in engine.scheduler.running if r.request_id == victim).state_slot
    assert engine.abort(victim)  # deferred: the forward still writes its pages and slot
    assert slot is not None and slot in engine.pool.slots.used_ids()  # type: ignore[union-attr]
    last = engine.add_request(prompts[2], GREEDY)
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != victim, "an aborted request produced an output"
            if out.finished:
                finished[out.request_id] = out.token_ids
    assert finished == {keep: expected["req-0"], last: expected["req-1"]}
    assert not engine.abort(victim)
    check_idle(engine)


def test_preemption_under_page_pressure_spares_the_prefill_in_flight() -> None:
    model_dir, _ = nemotron_h("M*")
    prompts = random_prompts([20, 20, 20, 20, 20], vocab=128, seed=17)
    config = ModelConfig.from_dir(model_dir)
    # 4 slots and 16 pages of 4 tokens: two requests of 36 tokens cannot both hold their KV
    budget = 4 * CacheLayout.bytes_per_slot(config, 3, torch.float32, torch.float32)
    budget += 16 * CacheLayout.bytes_per_page(config, 4, torch.float32)
    kwargs = dict(page_size=4, max_num_seqs=4, max_model_len=40, cpu_memory_gb=budget / 2**30, num_kv_pages=16,
                  prefill_chunk_size=8)
    colocated, engine, mux = engines(model_dir, 3, **kwargs)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = drive(colocated, staggered(prompts, params, every=1))
    held_preempted = []
    preempt = engine.scheduler._preempt

    def watched(request):  # a request whose prefill forward is in flight is never the victim
        held_preempted.append(id(request) in engine.scheduler.in_flight)
        preempt(request)

    engine.scheduler._preempt = watched
    assert drive(engine, staggered(prompts, params, every=1)) == expected
    assert engine.scheduler.num_preemptions > 0 and not any(held_preempted)
    check_idle(engine)


def test_without_sm_partitions_the_mode_warns_once_and_runs_colocated(caplog) -> None:
    model_dir, _ = nemotron_h("M*-M*")
    prompts = random_prompts([9, 30], vocab=128, seed=16)
    with caplog.at_level(logging.WARNING, logger="hybridserve.engine.multiplex"):
        llm = LLM(model_dir, pd_multiplex=True, prefill_chunk_size=16)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "co-located" in warnings[0].getMessage()
    assert llm.engine.multiplexer is None
    reference = LLM(model_dir, prefill_chunk_size=16).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    llm.engine.pool.check()


def test_config_refuses_tensor_parallel_and_bad_menus() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=1 or drop pd_multiplex"):
        EngineConfig(pd_multiplex=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pd_multiplex_prefill_sms"):
        EngineConfig(pd_multiplex=True, pd_multiplex_prefill_sms="32,lots")
    assert EngineConfig(pd_multiplex_prefill_sms="32,64").multiplex_menu(132) == (32, 64)
    assert EngineConfig().multiplex_menu(128) == (16, 32, 48, 64, 80, 96, 112)
    assert EngineConfig().multiplex_menu(132)[-1] == 112  # decode keeps 20 of 132 (12 failed cuBLAS GEMMs)
    assert max(EngineConfig().multiplex_menu(58)) == 40  # whole groups, all but two of them
    for bad in ({"pd_multiplex_decode_slowdown": 0.8}, {"pd_multiplex_tpot_slo_ms": -5.0},
                {"pd_multiplex_backlog_ms": float("inf")}, {"pd_multiplex_decode_slowdown": True}):
        with pytest.raises(ValueError, match="pd_multiplex_"):
            EngineConfig(**bad)  # type: ignore[arg-type]
    policy = EngineConfig(pd_multiplex_tpot_slo_ms=20.0, pd_multiplex_backlog_ms=0.0).split_policy
    assert policy.tpot_slo_ms == 20.0 and policy.backlog_ms == 0.0


def test_the_startup_profile_times_every_split_and_leaves_the_engine_clean() -> None:
    model_dir, _ = nemotron_h("M*-M*")
    prompts = random_prompts(LENGTHS, vocab=128, seed=14)
    colocated, engine, mux = engines(model_dir, 1, prefill_chunk_size=16, state_block=16)
    initial, seeds = mux.split, engine._seeds.getstate()
    forget, forgotten = mux.controller.forget, []
    mux.controller.forget = lambda: (forgotten.append(len(mux.controller.measured("prefill"))), forget())[1]  # type: ignore[method-assign]
    steps = profile_splits(engine, mux, rows=4)
    assert forgotten == [0, 1]  # the warm-up's times, then the first split's first (compiling) pass
    assert steps > 0 and mux.pinned is None and mux.split == initial == mux.controller.current
    assert mux.controller.changes == 0  # pinned splits are not the controller's changes
    # nothing of the profile is left: cached prefixes, counters, cache events, the seed stream, the handoff metrics
    assert engine.pool.num_hits == 0 and not engine.drain_cache_events() and engine._seeds.getstate() == seeds
    assert mux.counters.handoffs == 0 and mux.counters.overlapped_steps == 0
    splits = mux.controller.splits
    assert mux.controller.measured("prefill") == tuple(s.prefill_sms for s in splits)
    assert mux.controller.measured("decode") == tuple(sorted(s.decode_sms for s in splits))
    check_idle(engine)
    expected = drive(colocated, staggered(prompts))
    assert drive(engine, staggered(prompts)) == expected  # serving after the profile: the same tokens
    check_idle(engine)
    current = mux.split
    with pytest.raises(ValueError, match="not on the menu"):
        mux.pin(SmSplit(8, 124))
    assert mux.pinned is None and mux.split == current


def test_the_profile_fits_its_prompts_to_the_engine() -> None:
    """A tiny max_model_len: the prompts are clamped to it; the profile finishes and the engine serves."""
    model_dir, _ = nemotron_h("M*-M*")
    _, engine, mux = engines(model_dir, 0, prefill_chunk_size=16, max_model_len=12, max_num_seqs=2)
    assert profile_splits(engine, mux) > 0
    assert mux.controller.measured("prefill") and mux.controller.measured("decode")
    check_idle(engine)


def test_the_profile_skips_what_the_pool_cannot_hold(caplog: pytest.LogCaptureFixture) -> None:
    """A request the pool refuses (a ValueError, as serving would answer): that split is not profiled, with a
    WARNING, and the rest of the profile runs."""
    model_dir, _ = nemotron_h("M*-M*")
    _, engine, mux = engines(model_dir, 0, prefill_chunk_size=16)
    add, calls = engine.add_request, []

    def refusing_add(prompt, params, request_id=None):  # type: ignore[no-untyped-def]
        calls.append(request_id)
        if request_id == "split-profile-2-0":  # the second split's (0 and 1: the first split's two passes)
            raise ValueError("the pool cannot hold this prompt")
        return add(prompt, params, request_id=request_id)

    engine.add_request = refusing_add  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="hybridserve.engine.split_profile"):
        assert profile_splits(engine, mux, rows=2) > 0
    assert any("not fully profiled" in r.getMessage() for r in caplog.records)
    assert "split-profile-2-long" not in calls and "split-profile-3-long" in calls
    check_idle(engine)
