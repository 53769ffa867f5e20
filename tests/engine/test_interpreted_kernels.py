"""The whole engine with the Triton kernels (run on CPU tensors by Triton's interpreter: kernel_mode="interpret")
against the engine with the torch references (kernel_mode="reference"), on the tiny parity checkpoints: the same
greedy tokens, cold and on a prefix-cache hit (where the scan reads its state from a slot and writes the
checkpoints into the pool itself); seeded sampling through the sampler's kernel repeats its tokens."""

from __future__ import annotations

import os

import pytest
import torch
from checkpoints import random_prompts
from prefix_cases import greedy, model_dir, warm_llm

from hybridserve import LLM, SamplingParams
from hybridserve.kernels.ops import Kernels

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA engine tests cover this on a GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"),
]

PROMPTS = [[5 + (i * 7 + j) % 100 for j in range(n)] for i, n in enumerate((3, 40, 17, 90))]


def _run(kind: str, kernel_mode: str) -> dict:
    """Greedy tokens, a prefix-cache turn (warm hit) and a seeded sampled run twice, in one kernel mode."""
    llm = LLM(model_dir(kind), kernel_mode=kernel_mode)
    assert llm.engine.model.kernels == Kernels(kernel_mode)
    plain = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(6))
    sampled = [[o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=SamplingParams(
        max_tokens=4, temperature=0.8, seed=3, ignore_eos=True))] for _ in range(2)]
    warm = warm_llm(kind, kernel_mode=kernel_mode)
    system, a, b = random_prompts([37, 5, 9], vocab=128, seed=41)
    warm.generate(prompt_token_ids=[system + a], sampling_params=greedy(4))
    hit = warm.generate(prompt_token_ids=[system + b], sampling_params=greedy(4))[0]
    return {"plain": [o.token_ids for o in plain], "hit": hit.token_ids, "cached": hit.num_cached_tokens,
            "sampled": sampled[0], "sampled_again": sampled[1]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nemotron_h", "mamba2"])
def test_triton_kernels_give_reference_tokens(kind: str) -> None:
    reference = _run(kind, "reference")
    triton_run = _run(kind, "interpret")
    assert triton_run["cached"] >= 16, "the second prompt should hit the cached system prompt"
    for run in (reference, triton_run):  # seeded sampling repeats (Philox and CPU noise differ: not compared)
        sampled, again = run.pop("sampled"), run.pop("sampled_again")
        assert sampled == again and all(len(tokens) == 4 for tokens in sampled)
    assert triton_run == reference
