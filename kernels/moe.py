"""NemotronH mixture of experts, torch references: the sigmoid group-limited top-k router, the token -> expert
alignment the grouped GEMMs read, and the routed relu2 experts (bf16 or fp8 weights with per-channel scales).

Everything here is device-side and sync-free (no `.item()`, `.tolist()`, `unique`, data-dependent shapes), so
the same code runs eagerly on CPU and inside a CUDA graph. The Triton path is `moe_triton.py`.

Pairs: token t's j-th choice is pair p = t * top_k + j (the row of `topk_ids.flatten()`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridserve.kernels.fp8_linear import quantize_activation_ref

# tokens per chunk of the reference's [E, tokens, width] padded layout are capped so the layout stays under
# this many elements (a CPU prefill of a 128-expert model would otherwise allocate gigabytes)
_REF_LAYOUT_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class RouterSpec:
    """What the router needs from the MoE config (kept apart so kernels never import models)."""

    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # the shared expert split into this many expert-sized chunks, appended to every token's choice as experts
    # E, E+1, ... with weight 1, so the fused GEMMs run it with the routed ones (0: the shared expert runs apart)
    num_shared: int = 0


def route_topk(
    x: torch.Tensor,  # [N, hidden]
    weight: torch.Tensor,  # [E, hidden] router weight
    correction_bias: torch.Tensor,  # [E] e_score_correction_bias (fp32)
    spec: RouterSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [N, k] fp32, ids [N, k] int64), computed as transformers' NemotronHTopkRouter does: fp32
    logits, sigmoid scores; experts chosen on score + correction bias within the `topk_group` groups whose two
    best biased scores sum highest; weights are the unbiased scores, normalised (+1e-20) when norm_topk_prob,
    times routed_scaling_factor. With spec.num_shared, [N, k + num_shared]: the shared chunks appended."""
    scores = F.linear(x.float(), weight.float()).sigmoid()  # [N, E]
    choice = scores + correction_bias.float()
    if spec.n_group > 1:  # one group selects every expert: the mask is all ones (transformers computes it anyway)
        per_group = spec.num_experts // spec.n_group
        group_scores = choice.view(-1, spec.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        top_groups = group_scores.topk(spec.topk_group, dim=-1, sorted=False)[1]  # [N, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand(-1, -1, per_group).reshape(-1, spec.num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(spec.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * spec.routed_scaling_factor
    if spec.num_shared:
        n = ids.shape[0]
        shared = torch.arange(spec.num_experts, spec.num_experts + spec.num_shared, device=ids.device)
        ids = torch.cat([ids, shared.expand(n, -1)], dim=1)
        weights = torch.cat([weights, weights.new_ones(n, spec.num_shared)], dim=1)
    return weights, ids


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the aligned layout: every expert's pairs padded to a multiple of block_m; at most
    min(E, pairs) experts are hit, each wasting < block_m rows. A multiple of block_m."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort pairs by expert into blocks of block_m rows that each belong to one expert.

    -> sorted_pairs [R] int32 (pair index per row, num_pairs = padding; R = align_capacity),
       block_expert [R / block_m] int32 (the expert of each block; blocks past the used rows hold a valid
       expert id and must be skipped), used_rows [1] int32 (rows up to the last used block).
    Fixed output sizes for a given number of pairs: no host sync, CUDA-graph capturable."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    rows = align_capacity(pairs, num_experts, block_m)
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(flat, stable=True)[1]  # pairs grouped by expert, in pair order within one
    sorted_experts = flat[order]
    first_of_expert = counts.cumsum(0) - counts  # unpadded start of each expert in `order`
    rank = torch.arange(pairs, device=device) - first_of_expert[sorted_experts]
    sorted_pairs = torch.full((rows,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[starts[sorted_experts] + rank] = order.to(torch.int32)
    block_rows = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_rows, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_expert, ends[-1:].to(torch.int32)


# calls of at most this many (token, expert) pairs, tokens x (top_k + shared chunks), take the Triton small-M path
# (moe_small_triton.py: router, up and down GEMVs in three launches), which reads fp8 experts weight-only; larger
# calls take the grouped GEMMs. Nano has 6 + 2 slots, so 8 is one token: on the H200
# (bench/results/h200/kernels/moe.json) the small path ties the grouped GEMMs at 1 token (59.2 vs 59.6 us) and
# loses from 8 tokens on (301 vs 220 us)
SMALL_M_MAX_PAIRS = 8


def uses_fp8_activations(enabled: bool, w_up: torch.Tensor, num_pairs: int) -> bool:
    """Whether a layer with `fp8_activations` runs this call of `num_pairs` pairs W8A8: fp8 expert weights and a
    call above the small-M path's size, on every path alike (reference, Triton, expert parallel). The grouped
    fp8 x fp8 GEMMs (no fp8 -> bf16 cast of each weight tile) are faster at every measured size on an H200:
    1.8-2.0x at 2K-8K prefill tokens, 1.2-1.5x at 16-1,024 decode rows (bench/results/h200/decode_step/, prefill/)."""
    return enabled and w_up.dtype == torch.float8_e4m3fn and num_pairs > SMALL_M_MAX_PAIRS


def check_fp8_activations(fp8_activations: bool, w_up: torch.Tensor, shared_chunks: int) -> None:
    """ValueError unless W8A8 experts can run: fp8 expert weights, no shared chunks in the routed GEMMs."""
    if fp8_activations and (w_up.dtype != torch.float8_e4m3fn or shared_chunks):
        raise ValueError("fp8_activations needs fp8 expert weights (with scales) and the shared expert run apart, "
                         f"got {w_up.dtype} weights and {shared_chunks} shared chunks")


def _expert_bmm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,  # [E, C, in], [E, out, in], [E, out]
    fp8_activations: bool = False,
) -> torch.Tensor:
    """[E, C, out] = x @ weight^T (* scale) in x's dtype; fp8 weights multiply in fp32 and scale the product
    (the Triton kernel's order: exact fp8 -> bf16 cast, fp32 accumulation, scale on the accumulator). With
    fp8_activations each row of x is quantized to fp8 first (as the kernel's inputs are) and its scale multiplies
    the product."""
    if scale is None:
        return torch.bmm(x, weight.transpose(1, 2).to(x.dtype))
    if fp8_activations:
        quantized, row_scale = quantize_activation_ref(x.reshape(-1, x.shape[-1]))  # [E * C, in], [E * C, 1]
        product = torch.bmm(quantized.float().view(x.shape), weight.transpose(1, 2).float())
        product = product * row_scale.view(x.shape[0], x.shape[1], 1)
    else:
        product = torch.bmm(x.float(), weight.transpose(1, 2).float())
    return (product * scale.float()[:, None, :]).to(x.dtype)


def moe_experts_ref(
    x: torch.Tensor,  # [N, D] expert inputs (hidden states, or the latent projection)
    w_up: torch.Tensor,  # [E, I, D]
    w_down: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [N, k] fp32
    topk_ids: torch.Tensor,  # [N, k]
    up_scale: torch.Tensor | None = None,  # [E, I] fp32 per-channel scales of fp8 w_up
    down_scale: torch.Tensor | None = None,  # [E, D]
    shared_out: torch.Tensor | None = None,  # [N, D] in x's dtype: the shared expert's output, added at the end
    shared_up: torch.Tensor | None = None,  # [S * I, D]: the shared expert as S chunks, ids E .. E + S - 1
    shared_down: torch.Tensor | None = None,  # [D, S * I]
    fp8_activations: bool = False,  # fp8 weights: each GEMM's input rows quantized to fp8 per row (W8A8)
) -> torch.Tensor:
    """sum_j weight_j * down_e(relu2(up_e(x))) over each token's k experts -> [N, D] in x's dtype, summed in
    fp32 and rounded as transformers' NemotronHExperts does (then + shared_out). No loop over experts: pairs go
    into an [E, tokens, D] padded layout (an expert takes each token at most once, so `tokens` rows per expert
    always suffice) and both projections are one bmm each."""
    n, d = x.shape
    num_experts, k = w_up.shape[0], topk_ids.shape[1]
    out = torch.zeros(n, d, dtype=torch.float32, device=x.device)
    check_fp8_activations(fp8_activations, w_up, 0 if shared_up is None else shared_up.shape[0] // w_up.shape[1])
    if shared_up is not None and shared_down is not None:  # chunks of the shared expert: one bmm over them
        chunks = shared_up.shape[0] // w_up.shape[1]
        k -= chunks
        hidden = torch.relu(F.linear(x, shared_up)).square().view(n, chunks, -1).transpose(0, 1)  # [S, N, I]
        per_chunk = torch.bmm(hidden, shared_down.view(d, chunks, -1).permute(1, 2, 0))  # [S, N, D]
        out += (per_chunk.float() * topk_weights[:, k:].t().float()[..., None]).sum(0)
        topk_ids, topk_weights = topk_ids[:, :k], topk_weights[:, :k]
    chunk = max(1, _REF_LAYOUT_ELEMENTS // (num_experts * max(d, w_up.shape[1])))
    for t0 in range(0, n, chunk):  # token chunks bound the layout's memory (one chunk for small batches)
        ids = topk_ids[t0 : t0 + chunk].reshape(-1).long()
        tokens = ids.numel() // k
        order = torch.sort(ids, stable=True)[1]
        counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).scatter_add_(0, ids, torch.ones_like(ids))
        rank = torch.arange(ids.numel(), device=x.device) - (counts.cumsum(0) - counts)[ids[order]]
        slot = torch.empty_like(ids)
        slot[order] = ids[order] * tokens + rank  # row of each pair in the [E * tokens] layout
        layout = torch.zeros(num_experts * tokens, d, dtype=x.dtype, device=x.device)
        layout[slot] = x[t0 : t0 + tokens].repeat_interleave(k, dim=0)
        hidden = _expert_bmm(layout.view(num_experts, tokens, d), w_up, up_scale, fp8_activations)
        hidden = torch.relu(hidden).square()
        pair_out = _expert_bmm(hidden, w_down, down_scale, fp8_activations).reshape(num_experts * tokens, d)[slot]
        weighted = pair_out.float() * topk_weights[t0 : t0 + tokens].reshape(-1, 1).float()
        out[t0 : t0 + tokens] += weighted.view(tokens, k, d).sum(1)
    return out.to(x.dtype) if shared_out is None else out.to(x.dtype) + shared_out


def moe_layer_ref(
    x: torch.Tensor,  # [N, hidden] router input
    router_weight: torch.Tensor,  # [E, hidden]
    correction_bias: torch.Tensor,  # [E] fp32
    spec: RouterSpec,
    w_up: torch.Tensor,  # [E, I, D]
    w_down: torch.Tensor,  # [E, D, I]
    up_scale: torch.Tensor | None = None,  # [E, I]
    down_scale: torch.Tensor | None = None,  # [E, D]
    expert_x: torch.Tensor | None = None,  # [N, D] the experts' input when it is not x (latent MoE)
    shared_out: torch.Tensor | None = None,  # [N, D]
    shared_up: torch.Tensor | None = None,  # [S * I, D] with spec.num_shared = S
    shared_down: torch.Tensor | None = None,  # [D, S * I]
    small_max_pairs: int | None = None,  # the Triton path's dispatch threshold: one path here
    fp8_activations: bool = False,  # fp8 experts: W8A8 where `uses_fp8_activations` says so
) -> torch.Tensor:
    """A whole MoE layer's routed part: `route_topk` then `moe_experts_ref` -> [N, D] in the experts' dtype."""
    weights, ids = route_topk(x, router_weight, correction_bias, spec)
    a8 = uses_fp8_activations(fp8_activations, w_up, ids.numel())
    return moe_experts_ref(x if expert_x is None else expert_x, w_up, w_down, weights, ids, up_scale, down_scale,
                           shared_out, shared_up, shared_down, a8)


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] -> (float8_e4m3fn weights, per-channel fp32 scales [E, out]) with amax / 448 scaling."""
    amax = weight.float().abs().amax(dim=-1).clamp_min(1e-12)  # [E, out]
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    return (weight.float() / scale[..., None]).to(torch.float8_e4m3fn), scale
