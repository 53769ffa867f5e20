"""L2 prefetch of decode weights (kernels/l2_prefetch.py): the kernel changes nothing and refuses bad input, the
switch is checked, and decode steps with prefetches forked and joined inside each layer (eager, one graph per
step, staged graphs) give the same greedy tokens as with prefetching off."""

from __future__ import annotations

import pytest
import torch
from checkpoints import nemotron_h_moe

from hybridserve import LLM, SamplingParams
from hybridserve.kernels import l2_prefetch
from hybridserve.kernels.l2_prefetch import L2Prefetcher, prefetch_level

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_level_switch_is_checked(monkeypatch):
    monkeypatch.delenv("HYBRIDSERVE_L2_PREFETCH", raising=False)
    assert prefetch_level() == 1
    monkeypatch.setenv("HYBRIDSERVE_L2_PREFETCH", "0")
    assert prefetch_level() == 0
    monkeypatch.setenv("HYBRIDSERVE_L2_PREFETCH", "yes")
    with pytest.raises(ValueError, match="HYBRIDSERVE_L2_PREFETCH"):
        prefetch_level()


def test_not_wanted_on_cpu():
    assert not L2Prefetcher.wanted(torch.zeros(1, 8))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("numel", [1, 7, 4096, 3 * 131072 + 5])
def test_prefetch_changes_nothing(dtype, numel):
    from hybridserve.kernels.l2_prefetch_triton import l2_prefetch_triton

    base = torch.arange(numel + 3, device="cuda").to(dtype)
    for tensor in (base[:numel], base[3:]):  # aligned, and 3 elements in (the per-line form when unaligned)
        before = tensor.clone()
        for bulk in (True, False):
            l2_prefetch_triton(tensor, bulk=bulk)
        torch.cuda.synchronize()
        assert torch.equal(tensor, before)


@pytest.mark.gpu
@cuda
def test_prefetch_refuses_bad_input():
    from hybridserve.kernels.l2_prefetch_triton import l2_prefetch_triton

    with pytest.raises(ValueError, match="CUDA"):
        l2_prefetch_triton(torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch_triton(torch.zeros(4, 4, device="cuda").t())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("staged", [False, True])
def test_decode_with_prefetch_equals_without(monkeypatch, staged):
    """Every Mamba out_proj, attention o_proj and shared expert up (level 2, no size floor) prefetched."""
    monkeypatch.setattr(l2_prefetch.L2Prefetcher, "MIN_BYTES", 0)
    if staged:
        monkeypatch.setenv("HYBRIDSERVE_STAGED_GRAPHS", "1")
    model_dir = nemotron_h_moe("ME*M")[0]
    prompts = [[5 + (i * 11 + j) % 100 for j in range(n)] for i, n in enumerate((4, 33, 9))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("HYBRIDSERVE_L2_PREFETCH", "0")
    expected = [o.token_ids for o in LLM(model_dir, device="cuda", dtype="bfloat16", cuda_graphs=False).generate(
        prompt_token_ids=prompts, sampling_params=params)]
    monkeypatch.setenv("HYBRIDSERVE_L2_PREFETCH", "2")
    for graphs in (False, True):
        llm = LLM(model_dir, device="cuda", dtype="bfloat16", cuda_graphs=graphs)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        model = llm.engine.runner.model
        prefetcher = getattr(model, "model", model)._l2_prefetcher
        assert prefetcher is not None and prefetcher.launches > 0
        assert got == expected
