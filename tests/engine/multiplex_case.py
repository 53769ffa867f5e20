"""What the multiplexed engine's tests share (CPU with the fake partition, CUDA with green contexts): stepping an
engine while requests arrive."""

from __future__ import annotations

from hybridserve import SamplingParams
from hybridserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


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
