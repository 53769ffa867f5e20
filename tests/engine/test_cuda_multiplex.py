"""PD multiplexing on CUDA with green-context lanes: the multiplexed engine's greedy tokens (fp32) equal the
co-located engine's while requests arrive, with CUDA graphs captured in the lanes, the prefix cache and MTP; the
prefill forward is held in flight over decode steps so the lanes really run side by side; pools pass their check.
The start-up profile times every split's lanes first."""

from __future__ import annotations

import pytest
import torch
from checkpoints import nemotron_h, nemotron_h_mtp, random_prompts
from multiplex_case import drive, staggered

from hybridserve import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CASES = {
    "plain": (lambda: nemotron_h("M*-M*")[0], {}),
    "mtp": (lambda: nemotron_h_mtp()[0], {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}),
}


@pytest.mark.parametrize("whole_gpu", [False, True], ids=["lanes", "whole-gpu"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_multiplexed_greedy_equals_colocated(case: str, whole_gpu: bool) -> None:
    """`whole_gpu`: steps with one phase idle run co-located on the whole GPU (its own graphs) between lane steps."""
    factory, extra = CASES[case]
    model_dir = factory()
    kwargs = dict(device="cuda", dtype="float32", prefill_chunk_size=64, state_block=32, max_num_seqs=16,
                  gpu_memory_gb=1.0, pd_multiplex_prefill_sms="32,64", **extra)
    shared = random_prompts([70], vocab=128, seed=31)[0]
    prompts = random_prompts([3, 40, 130, 17, 90, 64, 9, 200], vocab=128, seed=32)
    arrivals = staggered(prompts, PARAMS, every=3)
    # a shared prefix, the second request long after the first's chunks completed: a prefix-cache hit
    arrivals += [(80 + 40 * i, shared + tail, PARAMS) for i, tail in enumerate(random_prompts([5, 33], vocab=128, seed=33))]
    colocated = LLMEngine(model_dir, EngineConfig(**kwargs))  # type: ignore[arg-type]
    expected = drive(colocated, arrivals)
    engine = LLMEngine(model_dir, EngineConfig(pd_multiplex=True, pd_multiplex_whole_gpu=whole_gpu,
                                               **kwargs))  # type: ignore[arg-type]
    mux = engine.multiplexer
    if mux is None:
        pytest.skip("no SM partitions on this machine (see the engine's WARNING)")
    # the start-up profile (after the warm-up) timed both lanes of every split, and left nothing behind
    splits = mux.controller.splits
    assert mux.controller.measured("prefill") == tuple(sorted(s.prefill_sms for s in splits))
    assert mux.controller.measured("decode") == tuple(sorted(s.decode_sms for s in splits))
    assert mux.counters.handoffs == 0 and not engine.has_unfinished()
    mux.prefill_delay = 2
    assert drive(engine, arrivals) == expected
    assert mux.counters.overlapped_steps > 0
    if whole_gpu:  # the first prompt prefills alone, the last requests decode alone: on the whole GPU
        assert mux.counters.whole_gpu_steps > 0 and mux.counters.handoffs > 0
    else:
        assert mux.counters.handoffs >= len(arrivals) and mux.counters.whole_gpu_steps == 0
    # decode graphs replayed: those captured in the decode lanes (and, with whole-GPU steps, the co-located ones;
    # which set each step asks is tested on the CPU)
    assert engine.graph_stats()["graph_decode_steps"] > 0
    assert engine.pool.num_hits > 0
    torch.cuda.synchronize()
    engine.pool.check()
    assert not engine.has_unfinished()
