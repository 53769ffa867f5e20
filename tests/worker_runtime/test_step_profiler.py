"""The step profiler: its config fields, and a trace of exactly the asked window of a loop's busy steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoints import nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.worker_runtime.engine_loop import EngineLoop
from hybridserve.worker_runtime.step_profiler import StepProfileConfig


def test_the_settings_parse_and_bad_ones_are_refused(tmp_path: Path) -> None:
    assert StepProfileConfig.from_engine(EngineConfig()) is None
    config = StepProfileConfig.from_engine(EngineConfig(profile_dir=str(tmp_path), profile_steps="5:3"))
    assert config == StepProfileConfig(tmp_path, 5, 3, False)
    stack = StepProfileConfig.from_engine(EngineConfig(profile_dir="d", profile_steps="0:1:stack"))
    assert stack is not None and stack.with_stack
    for bad in ("x", "5", "-1:3", "5:0", "5:3:frames", "1:2:3:4"):
        with pytest.raises(ValueError, match="profile_steps must be FIRST:COUNT"):
            EngineConfig(profile_dir="d", profile_steps=bad)


def test_a_loop_writes_a_trace_of_its_steps_window(tmp_path: Path) -> None:
    model_dir, _ = nemotron_h("M*")
    loop = EngineLoop(LLM(model_dir, profile_dir=str(tmp_path), profile_steps="2:3").engine, name="test-loop")
    try:
        outs = list(loop.generate(random_prompts([9], vocab=128, seed=2)[0],
                                  SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), "a"))
        assert outs[-1].finished
        path = loop.call(lambda: loop.profiler.trace_path)
    finally:
        loop.stop()
    assert path == tmp_path / "test-loop-steps2-4.json"
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("name") == "engine_step") == 3
    assert (tmp_path / "test-loop-steps2-4.txt").read_text().strip()
