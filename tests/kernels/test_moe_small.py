"""The small-M MoE layer (router logits GEMV, up with the in-kernel top-k choice, down with the fused combine)
against the torch reference layer and the grouped path, swept over shapes, groups, dtypes, shared experts
(fused chunks or a precomputed output), latent inputs and fp8 weights; the dispatch threshold; bad inputs."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

from hybridserve.kernels.moe import RouterSpec, moe_layer_ref, quantize_fp8_rows

triton = pytest.importorskip("triton")

import hybridserve.kernels.moe_small_triton as small  # noqa: E402
from hybridserve.kernels.moe_router_triton import router_logits  # noqa: E402
from hybridserve.kernels.moe_small_triton import moe_layer_triton  # noqa: E402


def _layer(tokens, experts, k, n_group, topk_group, d, inter, shared, dtype, seed=0, latent=None):
    """Random layer inputs; router logits spread (std ~2) so near-ties between experts are rare."""
    gen = torch.Generator().manual_seed(seed)
    hidden = d if latent is None else latent
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    spec = RouterSpec(experts, k, n_group, topk_group, True, 2.5, shared)
    inputs = dict(
        x=x, router_weight=(torch.randn(experts, hidden, generator=gen) * 2 * hidden**-0.5).to(dtype),
        correction_bias=torch.randn(experts, generator=gen) * 0.1, spec=spec,
        w_up=(torch.randn(experts, inter, d, generator=gen) * d**-0.5).to(dtype),
        w_down=(torch.randn(experts, d, inter, generator=gen) * inter**-0.5).to(dtype))
    if shared:
        inputs["shared_up"] = (torch.randn(shared * inter, d, generator=gen) * d**-0.5).to(dtype)
        inputs["shared_down"] = (torch.randn(d, shared * inter, generator=gen) * inter**-0.5).to(dtype)
    if latent is not None:
        inputs["expert_x"] = torch.randn(tokens, d, generator=gen).to(dtype)
    return inputs


# (tokens, experts, k, n_group, topk_group, d, inter, shared chunks)
SHAPES = [(1, 8, 2, 1, 1, 32, 48, 0), (1, 16, 3, 4, 2, 40, 24, 2), (3, 16, 4, 2, 1, 32, 32, 1),
          (5, 8, 2, 8, 3, 24, 40, 0), (8, 32, 6, 1, 1, 48, 16, 2)]


@ku.interp_only
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_path_matches_the_reference_layer(shape, dtype):
    tokens, experts, k, n_group, topk_group, d, inter, shared = shape
    inputs = _layer(tokens, experts, k, n_group, topk_group, d, inter, shared, dtype, seed=tokens + experts)
    ref = moe_layer_ref(**inputs)
    out = moe_layer_triton(**inputs, small_max_pairs=1 << 20)
    grouped = moe_layer_triton(**inputs, small_max_pairs=0)
    # bf16: the interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest), ~1.5 % on its own
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    ku.assert_close(out, ref, tol, "small path vs reference")
    ku.assert_close(out, grouped, tol, "small path vs grouped path")


@ku.interp_only
def test_router_logits_gemv_matches_fp32_linear():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 70, generator=gen).bfloat16(), torch.randn(12, 70, generator=gen).bfloat16()
    torch.testing.assert_close(router_logits(x, w), torch.nn.functional.linear(x.float(), w.float()),
                               rtol=1e-5, atol=1e-5)


@ku.interp_only
def test_small_path_adds_a_precomputed_shared_output_and_takes_latent_inputs():
    inputs = _layer(4, 8, 2, 1, 1, 16, 24, 0, torch.float32, seed=5, latent=40)
    shared_out = torch.randn(4, 16)
    ref = moe_layer_ref(**inputs, shared_out=shared_out)
    torch.testing.assert_close(ref, moe_layer_ref(**inputs) + shared_out)
    ku.assert_close(moe_layer_triton(**inputs, shared_out=shared_out), ref, 1e-5, "latent + shared_out")


@ku.interp_only
@pytest.mark.parametrize("tokens", [1, 6])
def test_small_path_fp8_experts(tokens):
    inputs = _layer(tokens, 8, 2, 1, 1, 32, 32, 0, torch.bfloat16, seed=tokens)
    inputs["w_up"], inputs["up_scale"] = quantize_fp8_rows(inputs["w_up"])
    inputs["w_down"], inputs["down_scale"] = quantize_fp8_rows(inputs["w_down"])
    ref = moe_layer_ref(**inputs)
    ku.assert_close(moe_layer_triton(**inputs), ref, 3e-2, "fp8 small path")
    ku.assert_close(moe_layer_triton(**inputs, small_max_pairs=0), ref, 3e-2, "fp8 grouped path")


@ku.interp_only
def test_dispatch_follows_the_pair_threshold(monkeypatch):
    calls = []
    real = small.moe_small_triton
    monkeypatch.setattr(small, "moe_small_triton", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for tokens in (1, 2, 3):  # 4 slots per token (3 routed + 1 shared chunk)
        moe_layer_triton(**_layer(tokens, 8, 3, 1, 1, 16, 16, 1, torch.float32), small_max_pairs=8)
    assert calls == [1, 2]
    monkeypatch.setattr(small, "SMALL_M_MAX_PAIRS", 4)
    moe_layer_triton(**_layer(2, 8, 3, 1, 1, 16, 16, 1, torch.float32))
    assert calls == [1, 2]


@ku.interp_only
def test_bad_inputs_name_what_to_change():
    inputs = _layer(2, 8, 2, 1, 1, 16, 16, 2, torch.float32)
    with pytest.raises(ValueError, match="shared-expert chunks"):
        moe_layer_triton(**{**inputs, "shared_up": None, "shared_down": None})
    with pytest.raises(ValueError, match="expert_x has"):
        moe_layer_triton(**inputs, expert_x=torch.randn(3, 16))
    with pytest.raises(ValueError, match="fp8 expert weights"):
        moe_layer_triton(**{**inputs, "spec": RouterSpec(8, 2, 1, 1, True, 2.5), "shared_up": None,
                            "shared_down": None}, up_scale=torch.ones(8, 16))


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("tokens", [1, 8, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_small_path_matches_the_reference_and_replays_as_a_graph(tokens, fp8):
    """Nano's routing (128 experts, top 6, 2 shared chunks or fp8 experts) at reduced widths on the GPU: the
    small path (shared programs ahead of the router wait) equals the reference layer and the grouped path, and a CUDA-graph
    replay gives the same bits."""
    inputs = _layer(tokens, 128, 6, 1, 1, 256, 128, 0 if fp8 else 2, torch.bfloat16, seed=tokens)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs["correction_bias"] = inputs["correction_bias"].float()
    if fp8:
        inputs["w_up"], inputs["up_scale"] = quantize_fp8_rows(inputs["w_up"])
        inputs["w_down"], inputs["down_scale"] = quantize_fp8_rows(inputs["w_down"])
        inputs["shared_out"] = torch.randn(tokens, 256, device="cuda").bfloat16()
    ref = moe_layer_ref(**inputs)
    out = moe_layer_triton(**inputs, small_max_pairs=1 << 20)
    ku.assert_close(out, ref, 1e-2, "small path vs reference")
    ku.assert_close(moe_layer_triton(**inputs, small_max_pairs=0), out, 1e-2, "grouped vs small path")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_layer_triton(**inputs, small_max_pairs=1 << 20)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)
