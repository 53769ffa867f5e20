"""Async scheduling (engine/async_step.py) gives exactly the synchronous step's tokens (the demo checkpoint, CPU):
greedy and seeded sampling (plain temperature and top-k / top-p), stop strings, EOS, max_tokens, max_model_len,
requests arriving while others run, aborts mid-run, preemption on a small KV pool, and a request that needs the
synchronous step (logprobs) among them. The pool's invariants hold after each run."""

from __future__ import annotations

import functools

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.models.default_model import default_model_dir

PROMPTS = ["def add(a, b):\n", "The quick brown fox", "import numpy as np\n", "x = [1, 2, 3]\nfor", "Hello, my name",
           "class Stack:\n    def", "# a comment\n", "while True:\n"]


def params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.0, max_tokens=14, ignore_eos=True),
        dict(temperature=0.8, seed=11 + i, max_tokens=12),
        dict(temperature=1.0, top_k=5, top_p=0.9, seed=7 + i, max_tokens=10),
        dict(temperature=0.0, max_tokens=16, stop=["\n"]),
        dict(temperature=0.7, seed=3, max_tokens=9, stop=[" the", "("]),
        dict(temperature=0.0, max_tokens=1),
    ]
    return SamplingParams(**kinds[i % len(kinds)])  # type: ignore[arg-type]


@functools.cache
def engine(async_scheduling: bool, num_kv_pages: int | None = None) -> LLMEngine:
    config = EngineConfig(max_num_seqs=4, max_model_len=48, async_scheduling=async_scheduling, prefill_chunk_size=16,
                          num_kv_pages=num_kv_pages)
    return LLMEngine(default_model_dir(), config)


def run(llm: LLMEngine, extra: dict[int, SamplingParams] | None = None, aborts: dict[int, str] | None = None,
        arrivals: int = 2) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Add two prompts, then `arrivals` more every step (others arrive while they run); abort per step index;
    returns each request's final (token ids, finish reason, text), or its last output when aborted."""
    final: dict[str, tuple[list[int], str | None, str | None]] = {}
    queue = [(f"r{i}", llm.encode(p), (extra or {}).get(i, params(i))) for i, p in enumerate(PROMPTS)]
    for rid, prompt, sp in queue[:2]:
        llm.add_request(prompt, sp, rid)
    queue = queue[2:]
    step = 0
    while llm.has_unfinished() or queue:
        for rid, prompt, sp in queue[:arrivals]:
            llm.add_request(prompt, sp, rid)
        queue = queue[arrivals:]
        for out in llm.step():
            final[out.request_id] = (list(out.token_ids), out.finish_reason, out.text)
        rid = (aborts or {}).get(step)
        if rid is not None:
            llm.abort(rid)
            final.setdefault(rid, ([], None, None))
            final[rid] = (final[rid][0], "abort", None)
        step += 1
    llm.pool.check()
    return final


def test_async_steps_give_the_synchronous_tokens() -> None:
    reference = run(engine(False))
    got = run(engine(True))
    assert got == reference
    assert engine(True).async_steps is not None and engine(True).async_steps.num_async_steps > 0
    assert {reason for _, reason, _ in reference.values()} >= {"length", "stop"}


def test_aborts_mid_run_leave_the_others_exact() -> None:
    reference = run(engine(False))
    aborts = {3: "r1", 5: "r4", 6: "r6"}
    got = run(engine(True), aborts=aborts)
    for rid, (tokens, reason, text) in got.items():
        if reason == "abort":
            assert tokens == reference[rid][0][: len(tokens)]
        else:
            assert (tokens, reason, text) == reference[rid]
    assert not engine(True).has_unfinished() and engine(True).async_steps.inflight is None  # type: ignore[union-attr]


def test_preemption_on_a_small_pool() -> None:
    small = engine(True, num_kv_pages=5)
    assert run(small, arrivals=4) == run(engine(False, num_kv_pages=5), arrivals=4) == run(engine(False))
    assert small.scheduler.num_preemptions > 0


def test_a_request_with_logprobs_steps_synchronously_among_async_ones() -> None:
    extra = {2: SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)}
    reference = run(engine(False), extra=extra)
    before = engine(True).async_steps.num_async_steps  # type: ignore[union-attr]
    assert run(engine(True), extra=extra) == reference
    assert engine(True).async_steps.num_async_steps > before  # type: ignore[union-attr]


def test_config_field() -> None:
    import pytest

    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        EngineConfig(async_scheduling="yes")  # type: ignore[arg-type]


def test_the_engine_loop_streams_async_steps() -> None:
    """A worker's loop over an async engine: concurrent generate calls stream the synchronous tokens, each
    output a longer prefix, and the loop ends idle with nothing in flight."""
    import threading

    from hybridserve.worker_runtime.engine_loop import EngineLoop

    reference = run(engine(False))
    loop = EngineLoop(LLMEngine(default_model_dir(), EngineConfig(max_num_seqs=4, max_model_len=48,
                                                                  async_scheduling=True, prefill_chunk_size=16)))
    got: dict[str, tuple[list[int], str | None, str | None]] = {}

    def client(i: int) -> None:
        seen: list[int] = []
        for out in loop.generate(loop.engine.encode(PROMPTS[i]), params(i), f"r{i}"):
            assert out.token_ids[: len(seen)] == seen
            seen = list(out.token_ids)
            got[out.request_id] = (seen, out.finish_reason, out.text)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert got == reference
        assert not loop.call(loop.engine.has_unfinished)
        loop.call(loop.engine.pool.check)
    finally:
        loop.stop()
