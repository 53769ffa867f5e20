"""Async scheduling on CUDA (decode graphs, prefill graphs, pinned copies, device-side input feed): the same tokens
as synchronous steps, greedy and seeded, with stops and arrivals (the CPU tests cover the rules; this covers the
device path)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import nemotron_h

from hybridserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5 + (i * 7 + j) % 100 for j in range(n)] for i, n in enumerate((3, 40, 17, 90, 9, 33))]
PARAMS = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=20, temperature=0.9, seed=5),
          SamplingParams(max_tokens=16, temperature=1.0, top_k=8, top_p=0.9, seed=9),
          SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[7, 11]),
          SamplingParams(max_tokens=1, temperature=0.0),
          SamplingParams(max_tokens=28, temperature=0.0)]


def _run(async_scheduling: bool) -> list[tuple[list[int], str | None]]:
    llm = LLM(nemotron_h("M*-M")[0], device="cuda", dtype="float32", max_num_seqs=4, max_model_len=256,
              async_scheduling=async_scheduling)
    engine = llm.engine
    ids = [engine.add_request(p, s) for p, s in zip(PROMPTS[:3], PARAMS[:3])]
    later = list(zip(PROMPTS[3:], PARAMS[3:]))
    final = {}
    while engine.has_unfinished() or later:
        if later:
            ids.append(engine.add_request(*later.pop(0)))
        for out in engine.step():
            final[out.request_id] = (list(out.token_ids), out.finish_reason)
    engine.pool.check()
    if async_scheduling:
        assert engine.async_steps is not None and engine.async_steps.num_async_steps > 0
    return [final[i] for i in ids]


def test_cuda_async_steps_give_the_synchronous_tokens():
    assert _run(True) == _run(False)
