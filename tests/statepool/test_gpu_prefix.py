"""On CUDA (Triton kernels write the checkpoints): prefix hits give the tokens of a cold CUDA run."""

from __future__ import annotations

import pytest
import torch
from checkpoints import random_prompts
from prefix_cases import greedy, warm_llm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
def test_cuda_hits_equal_cold(kind: str) -> None:
    warm = warm_llm(kind, device="cuda")
    cold = warm_llm(kind, device="cuda", enable_prefix_caching=False)
    system, a, b, c = random_prompts([37, 5, 9, 6], vocab=128, seed=41)
    turn1 = [system + a, system + b, system[:20] + c]
    outs = warm.generate(prompt_token_ids=turn1, sampling_params=greedy(20))
    turn2 = [p + o.token_ids + c for p, o in zip(turn1, outs)]
    for prompts in (turn1, turn2):
        got = warm.generate(prompt_token_ids=prompts, sampling_params=greedy(8))
        want = cold.generate(prompt_token_ids=prompts, sampling_params=greedy(8))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert all(o.num_cached_tokens >= 16 for o in got)
        warm.engine.pool.check()
    assert got[0].num_cached_tokens >= 48  # turn 2 hits past the 42-token turn-1 prompt
