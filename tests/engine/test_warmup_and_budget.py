"""Warm-up before serving (every launch family runs once, the engine is left clean) and the step token budget."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from checkpoints import nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.kernels import ops
from hybridserve.statepool.pool import NO_HIT

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
RECORDED = ("ssd_scan_varlen", "causal_conv1d_varlen", "causal_conv1d_update", "multi_token_state_update",
            "paged_attention")


def _record(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count the launch families the model's ops are called in (what Triton would compile separately)."""
    seen: Counter = Counter()
    for name in RECORDED:
        original = getattr(ops, name)

        def wrapped(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            starts = kwargs.get("start_positions")
            if _name == "ssd_scan_varlen":
                cu = args[5]
                seen["scan:many" if cu.numel() > 2 else "scan:one"] += 1
                if starts is not None and bool((starts > 0).any()):
                    seen["scan:resumed"] += 1
                if kwargs.get("checkpoint_rows") is not None:
                    seen["scan:checkpoints"] += 1
            elif _name == "paged_attention":
                seen["attention:prefill" if (kwargs.get("max_query_len") or 0) > 16 else "attention:decode"] += 1
            else:
                seen[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(ops, name, wrapped)
    return seen


def test_warmup_covers_every_launch_family_and_leaves_the_engine_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir, _ = nemotron_h("M*-M*")
    seen = _record(monkeypatch)
    llm = LLM(model_dir, warmup=True, state_block=16, prefill_chunk_size=64, max_model_len=256)
    report = llm.engine.warmup_report
    assert report is not None and report.num_requests >= 6 and not report.skipped
    expected = {"scan:many", "scan:one", "scan:resumed", "scan:checkpoints", "causal_conv1d_varlen",
                "causal_conv1d_update", "multi_token_state_update", "attention:prefill", "attention:decode"}
    assert expected <= set(seen), f"not warmed: {expected - set(seen)}"
    engine = llm.engine
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["free_state_slots"] == engine.pool.slots.num_free and engine.pool.slots.num_free > 0
    assert engine.drain_cache_events() == []
    engine.pool.check()
    # nothing of the warm-up stays cached, and serving gives what a cold engine gives
    prompts = random_prompts([40, 7, 90], vocab=128, seed=3)
    cold = LLM(model_dir, warmup=False, state_block=16, prefill_chunk_size=64, max_model_len=256)
    assert cold.engine.warmup_report is None
    warm_out = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in warm_out] == [o.token_ids for o in cold.generate(prompt_token_ids=prompts,
                                                                                  sampling_params=GREEDY)]
    assert all(o.num_cached_tokens == 0 for o in warm_out)


def test_warmup_skips_prompts_the_pool_cannot_take() -> None:
    model_dir, _ = nemotron_h("M*")
    llm = LLM(model_dir, warmup=True, max_model_len=24, prefill_chunk_size=8)
    report = llm.engine.warmup_report
    assert report is not None and max(report.prompt_lens) < 24
    assert llm.engine.pool.match(llm.engine._new_request([1, 2, 3], GREEDY, "probe")) == NO_HIT


def test_warmup_is_off_on_cpu_by_default() -> None:
    assert EngineConfig().warmup_enabled is False
    assert EngineConfig(warmup=True).warmup_enabled is True
    with pytest.raises(ValueError, match="warmup must be a bool"):
        EngineConfig(warmup="yes")  # type: ignore[arg-type]


def test_budget_caps_prefill_beside_decodes() -> None:
    model_dir, _ = nemotron_h("M*")
    llm = LLM(model_dir, max_num_seqs=4, prefill_chunk_size=32, max_num_batched_tokens=20)
    scheduler = llm.engine.scheduler
    assert scheduler.prefill_budget(0) == 20 and scheduler.prefill_budget(4) == 16
    engine = llm.engine
    for prompt in random_prompts([3, 3, 3, 60], vocab=128, seed=1):
        engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    steps = []
    while engine.has_unfinished():
        work = scheduler.schedule()
        steps.append((len(work.decodes), sum(c.num_tokens for c in work.prefills)))
        _run_scheduled(engine, work)
    assert all(d + p <= 20 for d, p in steps), steps
    assert any(d and p for d, p in steps), "some step mixed decode rows and a prefill chunk"


def _run_scheduled(engine: Any, work: Any) -> None:
    """Run one step whose work was already scheduled (the engine's step without its own schedule call)."""
    original = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: work
    try:
        engine.step()
    finally:
        engine.scheduler.schedule = original


def test_budget_gives_the_tokens_of_no_budget() -> None:
    model_dir, _ = nemotron_h("M*-M")
    prompts = random_prompts([30, 5, 41, 12], vocab=128, seed=9)
    free = LLM(model_dir).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    capped = LLM(model_dir, max_num_batched_tokens=33, prefill_chunk_size=16).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in capped] == [o.token_ids for o in free]


@pytest.mark.parametrize("budget", [0, 4, 32, True, 2.5])
def test_budget_must_leave_room_for_prefill(budget: object) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=32, max_num_batched_tokens=budget)  # type: ignore[arg-type]
