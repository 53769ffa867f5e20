"""What the multiplexed engine's tests share (CPU with the fake partition, CUDA with green contexts): stepping an
engine while requests arrive; on the CPU, a co-located and a multiplexed engine side by side, and lanes whose
forwards read as running for a few polls, as on a GPU."""

from __future__ import annotations

import dataclasses

from hybridserve import SamplingParams
from hybridserve.engine import multiplex, multiplex_setup
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.lane_flight import Fence
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.sm_partition import fake_partitioner
from hybridserve.engine.sm_split import SplitPolicy

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LENGTHS = [3, 17, 40, 9, 33, 5, 64, 21]  # across chunk boundaries of 16


def drive(engine: LLMEngine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Step the engine, adding each (step, prompt, params) at its step; the finished requests' token ids."""
    pending = sorted(arrivals, key=lambda a: a[0])
    finished: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            engine.add_request(prompt, params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        step += 1
        assert step < 5000, "the engine made no progress"
    return finished


def staggered(prompts: list[list[int]], params: SamplingParams = GREEDY, every: int = 2):
    return [(i * every, prompt, params) for i, prompt in enumerate(prompts)]


def engines(model_dir, delay: int, whole_gpu: bool = False, backlog_ms: float = 1000.0,
            **kwargs) -> tuple[LLMEngine, LLMEngine, multiplex.Multiplexer]:
    """(co-located engine, multiplexed engine over a fake partition, its multiplexer); `whole_gpu`: steps may run
    co-located on the whole GPU (off: every step in the lanes, which most tests exercise)."""
    colocated = LLMEngine(model_dir, EngineConfig(**kwargs))
    engine = LLMEngine(model_dir, EngineConfig(pd_multiplex=True, async_scheduling=True, **kwargs))
    policy = SplitPolicy(whole_gpu=whole_gpu, backlog_ms=backlog_ms)
    mux = multiplex_setup.attach(engine, fake_partitioner(132, (32, 64, 96)), policy)
    mux.prefill_delay = delay
    return colocated, engine, mux


def check_idle(engine: LLMEngine) -> None:
    engine.pool.check()
    assert not engine.has_unfinished()
    assert engine.pool.slots is None or engine.pool.num_free_slots == engine.pool.slots.capacity  # cache may borrow
    assert not getattr(engine.scheduler, "in_flight", {})


@dataclasses.dataclass(frozen=True)
class PendingFence(Fence):
    """A fake lane's fence that reads as running for its first `polls` queries (a decode step still on the GPU)."""

    polls: list[int] = dataclasses.field(default_factory=lambda: [3])

    def done(self) -> bool:
        self.polls[0] -= 1
        return self.polls[0] < 0


def slow_lanes(mux: multiplex.Multiplexer, prefill_polls: int = 1) -> None:
    """Each decode step reads as running for three polls and each prefill forward for `prefill_polls`: prefills
    complete beside decode steps, as on a GPU (with more polls than a decode step, beside a later one)."""
    launch_decode, launch_prefill = mux._launch_decode, mux._launch_prefill

    def slow_decode(lane, work):  # type: ignore[no-untyped-def]
        return dataclasses.replace(launch_decode(lane, work), done=PendingFence(None))

    def slow_prefill(lane, decode_lane):  # type: ignore[no-untyped-def]
        launched = launch_prefill(lane, decode_lane)
        if launched and mux.in_flight is not None:
            mux.in_flight = dataclasses.replace(mux.in_flight, done=PendingFence(None, [prefill_polls]))
        return launched

    mux._launch_decode, mux._launch_prefill = slow_decode, slow_prefill  # type: ignore[method-assign]
