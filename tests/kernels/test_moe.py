"""Fused MoE: the alignment (Triton vs torch reference, and its invariants), the reference experts against a
per-expert loop written out here, the Triton experts against the reference (bf16 / fp32 / fp8 weights), the
router against transformers' NemotronHTopkRouter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch
import torch.nn.functional as F

from hybridserve.kernels.fp8_linear import quantize_activation_ref
from hybridserve.kernels.moe import (
    RouterSpec,
    align_capacity,
    moe_align_ref,
    moe_experts_ref,
    quantize_fp8_rows,
    route_topk,
)

triton = pytest.importorskip("triton")

from hybridserve.kernels.moe_router_triton import route_topk_triton  # noqa: E402
from hybridserve.kernels.moe_triton import (  # noqa: E402
    choose_block_m,
    moe_align_triton,
    moe_experts_triton,
)


def _ids(tokens: int, k: int, experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])


def _check_alignment(ids: torch.Tensor, experts: int, block_m: int, align) -> None:
    sorted_pairs, block_expert, used = align
    flat = ids.reshape(-1)
    pairs = flat.numel()
    rows = align_capacity(pairs, experts, block_m)
    assert sorted_pairs.shape == (rows,) and block_expert.shape == (rows // block_m,)
    counts = torch.bincount(flat, minlength=experts)
    assert int(used) == int(((counts + block_m - 1) // block_m * block_m).sum())
    real = sorted_pairs[: int(used)]
    assert sorted(real[real < pairs].tolist()) == list(range(pairs))  # every pair exactly once
    assert bool((sorted_pairs[int(used):] == pairs).all())
    for row, pair in enumerate(real.tolist()):  # each real row sits in a block of its own expert
        if pair < pairs:
            assert int(block_expert[row // block_m]) == int(flat[pair])


@pytest.mark.parametrize("tokens,k,experts,block_m", [(1, 2, 8, 16), (5, 3, 8, 16), (40, 2, 4, 16), (9, 4, 16, 32),
                                                      (70, 2, 3, 64)])
@ku.interp_only  # CPU tensors through the Triton kernel
def test_align_reference_and_triton(tokens, k, experts, block_m):
    ids = _ids(tokens, k, experts, tokens + experts)
    _check_alignment(ids, experts, block_m, moe_align_ref(ids, experts, block_m))
    _check_alignment(ids, experts, block_m, moe_align_triton(ids, experts, block_m))


def _loop_experts(x, w_up, w_down, weights, ids):
    """The per-expert loop of transformers' NemotronHExperts, written out (test oracle only)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for expert in range(w_up.shape[0]):
        token, rank = torch.where(ids == expert)
        h = F.linear(torch.relu(F.linear(x[token], w_up[expert])).square(), w_down[expert])
        out.index_add_(0, token, (h * weights[token, rank, None]).float())
    return out.to(x.dtype)


def _case(tokens, k, experts, d, inter, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=gen).to(dtype)
    w_up = (torch.randn(experts, inter, d, generator=gen) * d**-0.5).to(dtype)
    w_down = (torch.randn(experts, d, inter, generator=gen) * inter**-0.5).to(dtype)
    weights = torch.rand(tokens, k, generator=gen)
    return x, w_up, w_down, weights, _ids(tokens, k, experts, seed)


@pytest.mark.parametrize("tokens", [1, 6, 33])
def test_reference_equals_the_expert_loop(tokens):
    x, w_up, w_down, weights, ids = _case(tokens, 3, 8, 24, 40, torch.float32)
    torch.testing.assert_close(moe_experts_ref(x, w_up, w_down, weights, ids),
                               _loop_experts(x, w_up, w_down, weights, ids), rtol=1e-5, atol=1e-6)


def test_reference_chunks_tokens(monkeypatch):
    import hybridserve.kernels.moe as moe

    x, w_up, w_down, weights, ids = _case(13, 2, 4, 16, 8, torch.float32)
    whole = moe_experts_ref(x, w_up, w_down, weights, ids)
    monkeypatch.setattr(moe, "_REF_LAYOUT_ELEMENTS", 4 * 16 * 3)  # 3 tokens per chunk
    torch.testing.assert_close(moe_experts_ref(x, w_up, w_down, weights, ids), whole)


@ku.interp_only
@pytest.mark.parametrize("tokens,k,experts,d,inter", [(1, 2, 8, 32, 48), (7, 3, 4, 40, 24), (50, 2, 4, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_experts_match_reference(tokens, k, experts, d, inter, dtype):
    x, w_up, w_down, weights, ids = _case(tokens, k, experts, d, inter, dtype, seed=tokens)
    out = moe_experts_triton(x, w_up, w_down, weights, ids)
    # bf16: the interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest), ~1.5 % on its own
    ku.assert_close(out, moe_experts_ref(x, w_up, w_down, weights, ids), 1e-5 if dtype == torch.float32 else 3e-2,
                    "moe out")


@ku.interp_only
def test_shared_expert_output_added_in_the_combine():
    x, w_up, w_down, weights, ids = _case(6, 2, 4, 24, 16, torch.float32, seed=8)
    shared = torch.randn(6, 24)
    ref = moe_experts_ref(x, w_up, w_down, weights, ids, shared_out=shared)
    torch.testing.assert_close(ref, moe_experts_ref(x, w_up, w_down, weights, ids) + shared)
    ku.assert_close(moe_experts_triton(x, w_up, w_down, weights, ids, shared_out=shared), ref, 1e-5, "with shared")
    with pytest.raises(ValueError, match="shared_out"):
        moe_experts_triton(x, w_up, w_down, weights, ids, shared_out=shared[:3])


@ku.interp_only
@pytest.mark.parametrize("tokens", [1, 9])
def test_shared_expert_chunks_run_as_extra_experts(tokens):
    """The shared expert [S * I, D] as S extra experts (ids E.., weight 1): Triton and reference equal the
    routed experts plus the shared MLP computed on its own."""
    x, w_up, w_down, weights, ids = _case(tokens, 2, 4, 24, 16, torch.float32, seed=tokens)
    gen = torch.Generator().manual_seed(1)
    shared_up, shared_down = torch.randn(32, 24, generator=gen) * 0.2, torch.randn(24, 32, generator=gen) * 0.2
    dense = moe_experts_ref(x, w_up, w_down, weights, ids) + F.linear(torch.relu(F.linear(x, shared_up)).square(),
                                                                       shared_down)
    ids_ext = torch.cat([ids, torch.tensor([4, 5]).expand(tokens, 2)], 1)
    weights_ext = torch.cat([weights, torch.ones(tokens, 2)], 1)
    ref = moe_experts_ref(x, w_up, w_down, weights_ext, ids_ext, shared_up=shared_up, shared_down=shared_down)
    torch.testing.assert_close(ref, dense, rtol=1e-5, atol=1e-6)
    out = moe_experts_triton(x, w_up, w_down, weights_ext, ids_ext, shared_up=shared_up, shared_down=shared_down)
    ku.assert_close(out, dense, 1e-5, "shared chunks")
    with pytest.raises(ValueError, match="whole"):
        moe_experts_triton(x, w_up, w_down, weights_ext, ids_ext, shared_up=shared_up[:24], shared_down=shared_down)


@ku.interp_only
@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_experts_triton_and_reference(per_tensor):
    x, w_up, w_down, weights, ids = _case(5, 2, 4, 32, 32, torch.bfloat16, seed=3)
    up8, up_s = quantize_fp8_rows(w_up)
    down8, down_s = quantize_fp8_rows(w_down)
    if per_tensor:  # one scale per expert tensor, as ModelOpt FP8 checkpoints store it, broadcast to rows
        up_s = up_s.amax(-1, keepdim=True).expand_as(up_s).contiguous()
        up8 = (w_up.float() / up_s[..., None]).to(torch.float8_e4m3fn)
    ref = moe_experts_ref(x, up8, down8, weights, ids, up_s, down_s)
    dense = moe_experts_ref(x, w_up, w_down, weights, ids)
    ku.assert_close(ref, dense, 0.08, "fp8 reference vs bf16")  # e4m3 keeps 3 mantissa bits
    ku.assert_close(moe_experts_triton(x, up8, down8, weights, ids, up_s, down_s), ref, 3e-2, "fp8 triton")


@ku.interp_only
@pytest.mark.parametrize("tokens,block_m", [(5, 16), (70, 64)])
def test_fp8_activation_experts_triton_and_reference(tokens, block_m, monkeypatch):
    """W8A8 experts: the kernel's fp8 x fp8 GEMMs against the reference that quantizes the same rows, and both
    within e4m3's reach of the weight-only and bf16 results. The rows are quantized by the reference here: the
    interpreter's own fp8 cast is not the GPU's (test_fp8_linear.py), the quantization kernel is tested there."""
    from hybridserve.kernels import moe_triton

    monkeypatch.setattr(moe_triton, "quantize_activation_triton", quantize_activation_ref)
    x, w_up, w_down, weights, ids = _case(tokens, 2, 4, 32, 32, torch.bfloat16, seed=5)
    up8, up_s = quantize_fp8_rows(w_up)
    down8, down_s = quantize_fp8_rows(w_down)
    ref = moe_experts_ref(x, up8, down8, weights, ids, up_s, down_s, fp8_activations=True)
    weight_only = moe_experts_ref(x, up8, down8, weights, ids, up_s, down_s)
    ku.assert_close(ref, weight_only, 0.08, "w8a8 vs weight-only fp8")
    ku.assert_close(ref, moe_experts_ref(x, w_up, w_down, weights, ids), 0.12, "w8a8 vs bf16")
    out = moe_experts_triton(x, up8, down8, weights, ids, up_s, down_s, block_m=block_m, fp8_activations=True)
    ku.assert_close(out, ref, 3e-2, "w8a8 triton")


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("tokens,block_m", [(64, 16), (384, 32), (700, 64), (2048, 128)])  # each tile family
def test_fp8_activation_experts_cuda(tokens, block_m):
    """30B-A3B expert shapes on the GPU: the W8A8 kernels (the Triton quantization, fp8 wgmma) against the
    reference on the same tensors, and against the weight-only result."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    d, inter, experts, k = 2688, 1856, 128, 6
    x = torch.randn(tokens, d, device="cuda", generator=gen).to(torch.bfloat16)
    up8, up_s = quantize_fp8_rows(torch.randn(experts, inter, d, device="cuda", generator=gen) * d**-0.5)
    down8, down_s = quantize_fp8_rows(torch.randn(experts, d, inter, device="cuda", generator=gen) * inter**-0.5)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(k, dim=-1)[1]
    weights = torch.rand(tokens, k, device="cuda", generator=gen)
    out = moe_experts_triton(x, up8, down8, weights, ids, up_s, down_s, block_m=block_m, fp8_activations=True)
    ref = moe_experts_ref(x, up8, down8, weights, ids, up_s, down_s, fp8_activations=True)
    ku.assert_close(out, ref, 3e-2, "w8a8 cuda")  # measured 1.55e-2: a relu2 row rounds before its quantization
    ku.assert_close(out, moe_experts_triton(x, up8, down8, weights, ids, up_s, down_s), 0.08, "w8a8 vs weight-only")


def test_fp8_activations_need_fp8_weights():
    x, w_up, w_down, weights, ids = _case(3, 2, 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="fp8_activations needs fp8 expert weights"):
        moe_experts_ref(x, w_up, w_down, weights, ids, fp8_activations=True)


@ku.interp_only
def test_triton_router_with_one_expert_per_group_matches_the_reference():
    """transformers cannot run this (its top-2 per group needs 2 experts); the reference takes each group's one."""
    gen = torch.Generator().manual_seed(4)
    x, weight, bias = torch.randn(9, 16, generator=gen), torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    spec = RouterSpec(8, 2, 8, 3, True, 1.5)
    ref_w, ref_ids = route_topk(x, weight, bias, spec)
    w, ids = route_topk_triton(x, weight, bias, spec)
    assert torch.equal(ids.sort(-1)[0], ref_ids.sort(-1)[0])
    torch.testing.assert_close(w.sort(-1)[0], ref_w.sort(-1)[0], rtol=1e-6, atol=0)


@ku.interp_only
@pytest.mark.parametrize("n_group", [1, 4])
def test_router_appends_the_shared_chunks(n_group):
    gen = torch.Generator().manual_seed(n_group)
    x, weight, bias = torch.randn(5, 16, generator=gen), torch.randn(16, 16, generator=gen), torch.randn(16, generator=gen)
    spec = RouterSpec(16, 3, n_group, min(2, n_group), True, 2.5, num_shared=2)
    for route in (route_topk, route_topk_triton):
        w, ids = route(x, weight, bias, spec)
        assert ids.shape == (5, 5) and bool((ids[:, 3:] == torch.tensor([16, 17])).all())
        assert bool((w[:, 3:] == 1.0).all())
        plain_w, plain_ids = route_topk(x, weight, bias, RouterSpec(16, 3, n_group, min(2, n_group), True, 2.5))
        assert torch.equal(ids[:, :3].sort(-1)[0], plain_ids.sort(-1)[0])
        torch.testing.assert_close(w[:, :3].sort(-1)[0], plain_w.sort(-1)[0], rtol=1e-6, atol=0)


@ku.interp_only
def test_block_m_override_gives_the_same_result():
    x, w_up, w_down, weights, ids = _case(20, 2, 4, 16, 16, torch.float32, seed=2)
    ref = moe_experts_ref(x, w_up, w_down, weights, ids)
    for block_m in (16, 32):
        ku.assert_close(moe_experts_triton(x, w_up, w_down, weights, ids, block_m=block_m), ref, 1e-5, "block_m")
    with pytest.raises(ValueError, match="block_m"):
        moe_experts_triton(x, w_up, w_down, weights, ids, block_m=48)


def test_block_m_grows_with_rows_per_expert():
    pairs = (6, 1536, 2304, 3072, 3840, 6144, 8192, 12288)  # 12, 18, 24, 30, 48, 64, 96 per expert after the first
    assert [choose_block_m(p, 128) for p in pairs] == [16, 16, 32, 32, 64, 64, 64, 128]


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (2, 1, False), (8, 3, True)])
@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=ku.interp_only)])  # CPU tensors
def test_router_matches_transformers(n_group, topk_group, norm, impl):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    config = NemotronHConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=n_group,
                             topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    torch.manual_seed(n_group)
    router = NemotronHTopkRouter(config)
    router.weight.data.normal_()
    router.e_score_correction_bias.data.normal_(0, 0.3)
    x = torch.randn(64, 32)
    spec = RouterSpec(16, 3, n_group, topk_group, norm, 2.5)
    _, hf_weights, hf_ids = router(x)
    route = route_topk if impl == "reference" else route_topk_triton
    weights, ids = route(x, router.weight, router.e_score_correction_bias, spec)
    order, hf_order = ids.sort(-1)[1], hf_ids.sort(-1)[1]
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    if impl == "reference":  # the same torch ops: bit for bit
        assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))
    else:  # Triton's sigmoid and sum may round differently in the last bit
        torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-6, atol=0)



def test_kernels_compile_for_hopper():
    """The kernels compiled for sm_90 without a GPU (Triton's bundled ptxas), in a process without the
    interpreter: catches what the interpreter does not (types, layouts, unsupported ops), and checks the GEMM's
    tiles are software-pipelined and that prefill tiles take Hopper's warpgroup MMA."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("moe_hopper_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ptx = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"small up *bf16", "small up *bf16 early", "small down *bf16", "small down *fp8e4nv",
            "router logits 4096", "router logits 32", "skinny split=4"} <= set(ptx)
    for name, found in ptx.items():
        assert found["cubin"], name
        if name.startswith("small up"):  # the GEMVs stream 16-byte vectors (an unaligned pointer gives 2-byte loads)
            assert found["ld.global.v4"], name
        if name.startswith("small down"):  # its weight tiles: software-pipelined 16-byte async copies
            assert found["cp.async"] and found["cp.async 16B"], name
        if name.startswith("gemm"):
            assert found["cp.async"] and found["cp.async 16B"], name
            assert found["wgmma"] == name.endswith("128"), name
    # W8A8 tiles multiply fp8 x fp8 on the tensor cores (e4m3 operands of the warpgroup MMA)
    assert ptx["gemm *fp8e4nv a8 up 128"]["wgmma e4m3"] and not ptx["gemm *fp8e4nv up 128"]["wgmma e4m3"]
    # under PDL the bf16 up kernel asks L2 for the shared expert's rows before waiting on the router kernel
    assert ptx["small up *bf16"]["prefetch.L2"] and not ptx["small up *fp8e4nv"]["prefetch.L2"]
    # under PDL a kernel waits on its predecessor and lets its successor launch (the up kernel after its work)
    for name in ("small up *bf16", "small up *bf16 early", "router logits 4096", "skinny split=4", "attention decode",
                 "attention combine", "attention write_kv"):
        assert ptx[name]["pdl wait"] and ptx[name]["pdl trigger"], name
