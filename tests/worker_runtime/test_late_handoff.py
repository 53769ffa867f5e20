"""Late hand-off (on by default): a synchronous step's outputs reach their streams once the next step's forward is
queued, never lost, in order, and the last ones at once when no step follows. Async steps return their outputs
after the next forward is queued already: they go out at once; requests that step synchronously on an async engine
(logprobs) keep the late hand-off."""

from __future__ import annotations

import queue
from typing import Any

from checkpoints import nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.common.outputs import RequestOutput
from hybridserve.worker_runtime.engine_loop import EngineLoop


class _Recorder(queue.Queue):
    """A stream that notes, per output, how many engine steps had started when it arrived."""

    def __init__(self, steps: list[int]) -> None:
        super().__init__()
        self.steps = steps
        self.log: list[tuple[int, int, bool]] = []  # (steps started, tokens so far, finished)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, RequestOutput):
            self.log.append((len(self.steps), len(item.token_ids), item.finished))
        super().put(item, block, timeout)


def _run(late: bool, model_dir, async_scheduling: bool = False, logprobs: int | None = None
         ) -> tuple[dict[str, list[tuple[int, int, bool]]], dict[str, list[int]]]:
    loop = EngineLoop(LLM(model_dir, async_scheduling=async_scheduling).engine, late_handoff=late)
    steps: list[int] = []
    real_step = loop.engine.step

    def counted_step(on_launched=None):  # type: ignore[no-untyped-def]
        steps.append(1)
        return real_step(on_launched=on_launched)

    loop.engine.step = counted_step  # type: ignore[method-assign]
    prompts = random_prompts([9, 5, 12], vocab=128, seed=4)
    sinks = {f"r{i}": _Recorder(steps) for i in range(len(prompts))}
    try:
        def add_all() -> None:  # one trip to the loop: the three requests start together
            for (name, sink), prompt in zip(sinks.items(), prompts):
                loop._streams[name] = sink
                loop.engine.add_request(prompt, SamplingParams(max_tokens=4 + len(prompt) % 3, temperature=0.0,
                                                               ignore_eos=True, logprobs=logprobs), name)

        loop.call(add_all)
        tokens = {name: list(loop.iterate(name, sink))[-1].token_ids for name, sink in sinks.items()}
    finally:
        loop.stop()
    return {name: sink.log for name, sink in sinks.items()}, tokens


def test_late_hand_off_delivers_every_output_one_launch_later() -> None:
    model_dir, _ = nemotron_h("M*")
    early_log, early_tokens = _run(False, model_dir)
    late_log, late_tokens = _run(True, model_dir)
    assert late_tokens == early_tokens  # the same tokens, nothing lost
    last_step = max(entry[0] for log in early_log.values() for entry in log)
    for name, early in early_log.items():
        late = late_log[name]
        assert [entry[1:] for entry in late] == [entry[1:] for entry in early]  # same outputs, same order
        assert late[-1][2]  # the finished output arrived
        for (early_steps, *_), (late_steps, *_) in zip(early, late):
            # early: handed off before the next step starts; late: once the next step runs, or at once after the
            # last step (no step follows it)
            assert late_steps == early_steps + (early_steps != last_step)
    # async steps: the same tokens and outputs; each output goes out in the step call that returned it (the step
    # that computed its token is the one before)
    async_log, async_tokens = _run(True, model_dir, async_scheduling=True)
    assert async_tokens == early_tokens
    for name, early in early_log.items():
        assert [entry[1:] for entry in async_log[name]] == [entry[1:] for entry in early]
        assert [entry[0] for entry in async_log[name]] == [steps + 1 for steps, *_ in early]
    # requests that step synchronously on an async engine (logprobs) keep the late hand-off
    sync_log, _ = _run(True, model_dir, logprobs=1)
    fallback_log, fallback_tokens = _run(True, model_dir, async_scheduling=True, logprobs=1)
    assert fallback_tokens == early_tokens and fallback_log == sync_log


def test_overlap_tasks_run_while_forwards_compute_and_when_idle(caplog) -> None:
    model_dir, _ = nemotron_h("M*")
    loop = EngineLoop(LLM(model_dir).engine)
    seen: list[tuple[bool, bool]] = []  # (idle, a forward was queued and its step not yet done)
    in_step = [False]
    real_step = loop.engine.step

    def marked_step(on_launched=None):  # type: ignore[no-untyped-def]
        in_step[0] = True
        try:
            return real_step(on_launched=on_launched)
        finally:
            in_step[0] = False

    loop.engine.step = marked_step  # type: ignore[method-assign]

    def failing(idle: bool) -> None:
        raise RuntimeError("a task's own bug")

    try:
        loop.add_overlap_task(lambda idle: seen.append((idle, in_step[0])))
        loop.add_overlap_task(failing)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        out = list(loop.generate(random_prompts([7], vocab=128, seed=3)[0], params, "r"))
        assert out[-1].finished and len(out[-1].token_ids) == 3  # a failing task does not fail the request
        loop.call(lambda: None)
    finally:
        loop.stop()
    assert (False, True) in seen and (True, False) in seen  # inside a step's forward, and idle between requests
    assert all(in_step_ == (not idle) for idle, in_step_ in seen)
    assert "overlap task" in caplog.text
