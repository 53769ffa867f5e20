"""PD multiplexing's whole-GPU steps on CPU with the fake partition: while one phase idles or a deep backlog drains,
steps run co-located (a step ahead of their tokens), the rest in the lanes; greedy tokens equal the co-located
engine's, each step asks the graphs of where it runs, and the pool passes its check after every test."""

from __future__ import annotations

import pytest
from checkpoints import nemotron_h, nemotron_h_mtp, random_prompts
from multiplex_case import GREEDY, LENGTHS, check_idle, drive, engines, slow_lanes, staggered

from hybridserve import SamplingParams
from hybridserve.engine import multiplex
from hybridserve.engine.lane_graphs import LaneGraphs


class GraphsProbe:
    """Stands in for a set of CUDA graphs (decode and prefill): records which set the runner asked, and whether the
    step was a whole-GPU one in which split, then declines, so the step runs eagerly."""

    def __init__(self, name: str, mux: multiplex.Multiplexer, asked: list[tuple[str, bool, str]]) -> None:
        self.name, self.mux, self.asked = name, mux, asked

    def bucket_for(self, batch):  # type: ignore[no-untyped-def]  # DecodeGraphs'
        self.asked.append((self.name, self.mux.whole, str(self.mux.split)))

    def run(self, input_ids, batch):  # type: ignore[no-untyped-def]  # PrefillGraphs'
        self.asked.append((self.name, self.mux.whole, str(self.mux.split)))


def test_each_step_asks_the_graphs_of_where_it_runs() -> None:
    """Whole-GPU steps ask the co-located graphs, lane steps their split's; a split cannot be pinned while a
    whole-GPU step is in flight (async)."""
    model_dir, _ = nemotron_h("M*-M*")
    prompts = random_prompts(LENGTHS, vocab=128, seed=11)
    colocated, engine, mux = engines(model_dir, 2, True, prefill_chunk_size=16, enable_prefix_caching=False)
    expected = drive(colocated, staggered(prompts))
    asked: list[tuple[str, bool, str]] = []
    for split in mux.controller.splits:
        probe = GraphsProbe(str(split), mux, asked)
        mux.graphs[split] = LaneGraphs(probe, probe)  # type: ignore[arg-type]
    whole = GraphsProbe("whole", mux, asked)
    mux.whole_graphs = LaneGraphs(whole, whole)  # type: ignore[arg-type]
    mux._use_graphs()
    assert drive(engine, staggered(prompts)) == expected
    assert {name for name, _, _ in asked} > {"whole"}  # both kinds of step ran
    assert all(in_whole == (name == "whole") and (in_whole or name == split) for name, in_whole, split in asked)
    engine.add_request(prompts[0], GREEDY)
    engine.step()  # nothing decodes: a whole-GPU step, a step ahead of its tokens
    assert engine.async_steps is not None and engine.async_steps.busy
    with pytest.raises(RuntimeError, match="in flight"):
        mux.pin(mux.controller.splits[0])
    while engine.has_unfinished():
        engine.step()
    check_idle(engine)


@pytest.mark.parametrize("case", ["burst", "mtp and prefix cache"])
def test_a_deep_backlog_drains_on_the_whole_gpu_then_lanes_resume(case: str) -> None:
    """A burst whose prefill takes longer than backlog_ms: whole-GPU steps until nothing waits (the decodes that
    start meanwhile too), then lanes for the prompts arriving later; the tokens stay the co-located engine's."""
    spec = {"method": "mtp", "num_speculative_tokens": 2} if case != "burst" else None
    model_dir = nemotron_h_mtp()[0] if spec else nemotron_h("M*-M*")[0]
    shared = random_prompts([32], vocab=128, seed=19)[0]
    prompts = random_prompts(LENGTHS, vocab=128, seed=18)
    if spec:
        prompts = [shared + p for p in prompts]
    burst, later = prompts[:5], prompts[5:]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # still decoding when the later ones come
    arrivals = [(0, p, long) for p in burst] + [(15 + 2 * i, p, GREEDY) for i, p in enumerate(later)]
    # backlog_ms between one prompt's predicted prefill (a lane: ~0.035 ms/token x 132/96) and the burst's
    colocated, engine, mux = engines(model_dir, 1, True, backlog_ms=4.0, prefill_chunk_size=16, state_block=16,
                                     speculative_config=spec, enable_prefix_caching=bool(spec))
    expected = drive(colocated, arrivals)
    draining = []
    whole_gpu = mux.controller.whole_gpu

    def watched(waiting: int, decoding: int) -> bool:
        draining.append(mux.controller.draining)
        return whole_gpu(waiting, decoding)

    mux.controller.whole_gpu = watched  # type: ignore[method-assign]
    assert drive(engine, arrivals) == expected
    stats = mux.stats()
    assert mux.controller.draining is False and any(draining)
    assert stats["prefill_tokens_by_sms"][132] >= sum(len(p) for p in burst) - (32 * 4 if spec else 0)
    assert mux.counters.handoffs > 0  # the later prompts, one at a time beside decodes: in the lanes
    if spec:
        assert engine.pool.num_hits > 0 and engine.spec is not None
    check_idle(engine)
    check_idle(colocated)


def test_a_backlog_arriving_while_prefills_run_beside_decode_starts_a_drain() -> None:
    """A prefill relaunched beside a decode step keeps the lane's prefill in flight when the next step starts, where
    the drain is otherwise decided; a burst arriving then must still drain on the whole GPU: no prefill is launched
    in a lane while the backlog is deep. The backlog rule is pinned to a token count so the test does not depend on
    the CPU's step times."""
    model_dir, _ = nemotron_h("M*-M*")
    prompts = random_prompts([40, 120, 64, 64, 64, 64, 64, 64], vocab=128, seed=21)
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    arrivals = [(0, prompts[0], long), (3, prompts[1], long)] + [(5, p, GREEDY) for p in prompts[2:]]
    colocated, engine, mux = engines(model_dir, 0, True, prefill_chunk_size=16, state_block=16)
    expected = drive(colocated, arrivals)
    mux.controller.backlog_deep = lambda waiting, decoding: waiting > 200  # type: ignore[method-assign]
    launch_prefill, waiting_at_launch = mux._launch_prefill, []

    def watched(lane, decode_lane):  # type: ignore[no-untyped-def]
        waiting_at_launch.append(engine.scheduler.load()[0])
        return launch_prefill(lane, decode_lane)

    mux._launch_prefill = watched  # type: ignore[method-assign]
    slow_lanes(mux, prefill_polls=2)  # a relaunched prefill is still in flight when the next step starts
    assert drive(engine, arrivals) == expected
    stats = mux.stats()
    assert stats["prefills_beside_decode"] > 0  # the second prompt's chunks: relaunched beside decode steps
    assert waiting_at_launch and max(waiting_at_launch) <= 200  # never a lane prefill with the backlog deep
    assert stats["prefill_tokens_by_sms"][132] >= 6 * 64 - 200  # the burst drained on the whole GPU
    check_idle(engine)


def test_the_load_counts_only_prompts_the_batch_can_seat() -> None:
    """A prompt waiting for a seat in a full batch is no prefill work for the split: decode keeps the whole GPU."""
    model_dir, _ = nemotron_h("M*-M*")
    prompts = random_prompts([9, 12, 30], vocab=128, seed=23)
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    _, engine, mux = engines(model_dir, 0, True, prefill_chunk_size=16, max_num_seqs=2)
    for prompt in prompts[:2]:
        engine.add_request(prompt, long)
    while mux.scheduler.decoding_rows() < 2:
        engine.step()
    assert mux.scheduler.load() == (0, 2)
    engine.add_request(prompts[2], long)
    assert mux.scheduler.load() == (0, 2) and mux.controller.whole_gpu(0, 2)
    while engine.has_unfinished():
        engine.step()
    check_idle(engine)
