"""The engine on CUDA (Triton kernels) against the engine on CPU (torch references) on the tiny parity
checkpoints: fp32 on the GPU must give the CPU's greedy tokens; bf16 must agree on the top-1 token of the
prompt logits at >= 90 % of positions with a relative logit error under 5 %."""

from __future__ import annotations

import pytest
import torch
from checkpoints import mamba2, nemotron_h

from hybridserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + (i * 7 + j) % 100 for j in range(n)] for i, n in enumerate((3, 40, 17, 90))]


def _model_dir(family: str):
    return nemotron_h("M*-M")[0] if family == "nemotron_h" else mamba2()[0]


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_cuda_fp32_greedy_equals_cpu(family):
    model_dir = _model_dir(family)
    cpu = LLM(model_dir).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    gpu = LLM(model_dir, device="cuda", dtype="float32").generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_cuda_bf16_prompt_logits_close_to_cpu(family):
    model_dir = _model_dir(family)
    prompt = PROMPTS[3]
    ref = LLM(model_dir).prompt_logits(prompt)
    got = LLM(model_dir, device="cuda", dtype="bfloat16").prompt_logits(prompt).cpu()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = ((got - ref).norm() / ref.norm()).item()
    assert agree >= 0.9 and err < 0.05, f"top-1 agreement {agree:.2f}, relative logit error {err:.3f}"
