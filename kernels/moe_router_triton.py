"""Triton MoE router: the sigmoid top-k choice with group limits and the correction bias, exactly as
transformers' NemotronH computes it (`kernels/moe.py` has the torch reference), and a GEMV for the router
logits at decode token counts. Shared by the grouped path (`moe_triton.py`) and the small-M path
(`moe_small_triton.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.moe import RouterSpec, route_topk
from hybridserve.kernels.triton_utils import (
    cdiv,
    gemv_fma,
    interpreting,
    next_pow2,
    pdl_gate,
    pdl_launch,
    prefetch_l2,
)


@triton.jit
def topk_choice(
    logits_ptr, bias_ptr, row, E, scaling,
    K: tl.constexpr, K_BLOCK: tl.constexpr, N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr, SHARED: tl.constexpr,
):
    """Token `row`'s choice from its fp32 logits [E]: sigmoid scores, bias-corrected choice limited to the
    TOPK_GROUP groups with the best top-2 sums, K arg-maxes; weights are the unbiased scores (normalised) times
    the scaling factor; slots K .. K + SHARED - 1 hold the shared chunks (experts E.., weight 1).
    -> (ids [K_BLOCK] int64, weights [K_BLOCK] fp32). Shared by the router kernel and the small-M up kernel."""
    offs = tl.arange(0, N_GROUP * PER_GROUP)
    valid = offs < E
    score = tl.sigmoid(tl.load(logits_ptr + row * E + offs, mask=valid, other=0.0))
    choice = tl.where(valid, score + tl.load(bias_ptr + offs, mask=valid, other=0.0), float("-inf"))
    if N_GROUP > 1:
        grouped = tl.reshape(choice, [N_GROUP, PER_GROUP])
        member = tl.arange(0, PER_GROUP)[None, :]
        best = tl.max(grouped, 1)
        first = tl.argmax(grouped, 1)
        group_score = best
        if PER_GROUP > 1:  # the sum of each group's two best (one expert per group: its only one)
            group_score += tl.max(tl.where(member == first[:, None], float("-inf"), grouped), 1)
        groups = tl.arange(0, N_GROUP)
        keep = groups < 0
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(group_score, 0)
            keep = keep | (groups == pick)
            group_score = tl.where(groups == pick, float("-inf"), group_score)
        grouped = tl.where(keep[:, None], grouped, float("-inf"))
        choice = tl.reshape(grouped, [N_GROUP * PER_GROUP])
    slots = tl.arange(0, K_BLOCK)
    chosen = tl.zeros([K_BLOCK], dtype=tl.int64)
    weight = tl.zeros([K_BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        pick = tl.argmax(choice, 0)
        chosen = tl.where(slots == j, pick.to(tl.int64), chosen)
        weight = tl.where(slots == j, tl.sum(tl.where(offs == pick, score, 0.0), 0), weight)
        choice = tl.where(offs == pick, float("-inf"), choice)
    if NORM:
        weight = weight / (tl.sum(weight, 0) + 1e-20)
    weight = weight * scaling
    if SHARED > 0:  # the shared expert's chunks: experts E .. E + SHARED - 1, weight 1
        chosen = tl.where(slots >= K, (E + slots - K).to(tl.int64), chosen)
        weight = tl.where(slots >= K, 1.0, weight)
    return chosen, weight


@lean_launch
@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, scaling,
    K: tl.constexpr, K_BLOCK: tl.constexpr, N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr, SHARED: tl.constexpr,
):
    """One token per program: `topk_choice`, stored as [N, K + SHARED] ids and weights."""
    row = tl.program_id(0).to(tl.int64)
    chosen, weight = topk_choice(logits_ptr, bias_ptr, row, E, scaling, K, K_BLOCK, N_GROUP, PER_GROUP,
                                 TOPK_GROUP, NORM, SHARED)
    slots = tl.arange(0, K_BLOCK)
    width = K + SHARED
    tl.store(ids_ptr + row * width + slots, chosen, mask=slots < width)
    tl.store(weights_ptr + row * width + slots, weight, mask=slots < width)


@lean_launch
@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, logits_ptr, E, D, x_m, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """logits[t, e] = sum_k x[t, k] * W[e, k] in fp32 from the weight's own dtype (no fp32 copy of it): one
    program per (token, BLOCK_E experts), so a few tokens' router GEMV spreads over many SMs. Under PDL the
    program's weight rows (one pointer per 64 elements) head for L2 before it waits on the kernel before."""
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    if USE_PDL:
        lines = tl.minimum(tl.arange(0, (BLOCK_K + 63) // 64) * 64, D - 1)  # >= 1 line for tiny rows
        prefetch_l2(w_ptr + tl.minimum(offs_e, E - 1).to(tl.int64)[:, None] * D + lines[None, :])
    pdl_gate(USE_PDL)
    logits = gemv_fma(x_ptr + row * x_m, w_ptr + offs_e.to(tl.int64)[:, None] * D, e_ok, D, BLOCK_E, BLOCK_K)
    tl.store(logits_ptr + row * E + offs_e, logits, mask=e_ok)


# up to this many tokens the router logits come from `_router_logits_kernel` (one launch, no fp32 weight copy);
# above, cuBLAS (the weight read once for all tokens)
ROUTER_GEMV_MAX_TOKENS = 16


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[N, hidden] x, [E, hidden] weight -> fp32 logits [N, E], as F.linear(x.float(), weight.float())."""
    n, (num_experts, d) = x.shape[0], weight.shape
    if n > ROUTER_GEMV_MAX_TOKENS or n == 0:
        return F.linear(x.float(), weight.float()).contiguous()
    x, weight = x.contiguous(), weight.contiguous()
    logits = torch.empty(n, num_experts, dtype=torch.float32, device=x.device)
    # a whole row per step (one dependent memory round trip for hidden <= 4096), 8K elements per program
    block_k = 32 if interpreting() else min(next_pow2(d), 4096)
    block_e = 8 if interpreting() else max(1, 8192 // block_k)
    _router_logits_kernel[(n, cdiv(num_experts, block_e))](x, weight, logits, num_experts, d, x.stride(0),
                                                                  BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
                                                                  **pdl_launch(x.device))
    return logits


def groups_fit(spec: RouterSpec) -> bool:
    """The choice kernel needs power-of-two groups and experts per group (others take the reference)."""
    per_group = spec.num_experts // spec.n_group
    return not (per_group & (per_group - 1) or spec.n_group & (spec.n_group - 1))


def route_topk_triton(
    x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor, spec: RouterSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `route_topk`: fp32 logits (`router_logits`), then one kernel for the choice (10 torch
    kernels in the reference). Expert counts / groups that are not powers of two take the reference."""
    if not groups_fit(spec):
        return route_topk(x, weight, correction_bias, spec)
    per_group = spec.num_experts // spec.n_group
    logits = router_logits(x, weight)  # [N, E]
    n, width = logits.shape[0], spec.top_k + spec.num_shared
    weights = torch.empty(n, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, width, dtype=torch.int64, device=x.device)
    if n:
        _route_kernel[(n,)](logits, correction_bias.float().contiguous(), weights, ids, spec.num_experts,
                            float(spec.routed_scaling_factor), K=spec.top_k, K_BLOCK=next_pow2(width),
                            N_GROUP=spec.n_group, PER_GROUP=per_group, TOPK_GROUP=spec.topk_group,
                            NORM=spec.norm_topk_prob, SHARED=spec.num_shared,
                            num_warps=1 if spec.num_experts <= 256 else 4)
    return weights, ids
