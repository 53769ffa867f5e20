"""The engine loop's step / gap accounting: steps and the gaps between busy steps, idleness not counted."""

from __future__ import annotations

import logging

import pytest
from checkpoints import nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.engine.step_timing import StepClock, StepTiming
from hybridserve.worker_runtime.engine_loop import EngineLoop
from hybridserve.worker_runtime.loop_stats import LoopStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_gaps_count_only_between_back_to_back_steps(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    stats = LoopStats("loop", log_every_s=100.0, clock=clock)
    clock.now = 0.004
    stats.record(0.0, 0.003, 4)  # the first step: no gap before it
    clock.now = 0.006
    stats.record(0.005, 0.006, 4)  # 1 ms after the previous hand-off ended at 0.004
    stats.idle()
    clock.now = 1.002
    stats.record(1.0, 1.002, 2)  # after idleness: no gap
    assert stats.steps == 3 and stats.outputs == 10
    assert stats.step_seconds == pytest.approx(0.003 + 0.001 + 0.002)
    assert stats.gap_seconds == pytest.approx(0.001) and stats.gaps == 1
    with caplog.at_level(logging.INFO):
        clock.now = 200.0
        stats.record(199.0, 200.0, 1)
    assert "4 steps" in caplog.text and "outputs/step" in caplog.text


def test_decode_only_steps_are_counted_apart() -> None:
    stats = LoopStats("loop", log_every_s=100.0, clock=FakeClock())
    stats.record(0.0, 0.030, 1, StepTiming(3, 1024, wait=0.029))  # mixed: 3 decodes beside a prefill chunk
    stats.record(0.031, 0.037, 4, StepTiming(4, 0, schedule=0.001, wait=0.005))  # decode-only, 4 rows
    stats.record(0.038, 0.045, 4, StepTiming(4, 0, launch=0.001, wait=0.006))
    stats.record(0.050, 0.080, 1, StepTiming(0, 512, wait=0.03))  # prefill only
    stats.record(0.081, 0.082, 1)  # no timing: counted as a step only
    assert stats.steps == 5 and stats.decode_only_steps == 2 and stats.decode_only_rows == 8
    assert stats.decode_only_seconds == pytest.approx(0.006 + 0.007)
    phases = stats.decode_only_phase_seconds
    assert phases["wait"] == pytest.approx(0.011) and phases["schedule"] == phases["launch"] == pytest.approx(0.001)


def test_a_bad_log_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="log_every_s"):
        LoopStats("loop", log_every_s=0)


def test_the_loop_counts_its_steps() -> None:
    model_dir, _ = nemotron_h("M*")
    loop = EngineLoop(LLM(model_dir).engine)
    try:
        outs = list(loop.generate(random_prompts([9], vocab=128, seed=2)[0],
                                  SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), "a"))
        assert outs[-1].finished
        stats = loop.call(lambda: loop.stats)
        assert stats.steps >= 5 and stats.outputs >= 5 and stats.step_seconds > 0
        assert stats.gap_seconds >= 0
        # one prompt of 9 tokens (prefill chunks), then decode-only steps of one row each
        assert stats.decode_only_steps >= 4 and stats.decode_only_rows == stats.decode_only_steps
        assert 0 < stats.decode_only_seconds < stats.step_seconds
        # the phases are parts of the step: together at most its time, the GPU wait among them
        assert 0 < sum(stats.decode_only_phase_seconds.values()) <= stats.decode_only_seconds
        assert stats.decode_only_phase_seconds["wait"] > 0
        # a step with nothing to run leaves no shape behind (the loop must not count it as a decode step)
        assert loop.call(lambda: (loop.engine.step(), loop.engine.last_step)) == ([], StepTiming())
    finally:
        loop.stop()


def test_a_step_without_overlapped_work_counts_it_as_launch() -> None:
    """A forward that never ran the overlapped window: its whole execution is launch, nothing overlapped or waited."""
    clock = StepClock()
    clock.schedule_done()
    clock.execute_done()
    timing = clock.timing(2, 0)
    assert timing.decode_only and timing.while_running == 0.0 and timing.wait == 0.0 and timing.launch >= 0.0
