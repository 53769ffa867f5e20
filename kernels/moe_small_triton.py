"""Triton MoE layer for decode-sized batches: no sorting, alignment or padded blocks, three launches.

At a handful of tokens the grouped path's alignment, 16-row padded blocks and separate combine are launch
latency, not work (1 token on an H200: ~7 launches, 1.9x the bytes floor). Here every (token, slot) pair is
one GEMV and the launches are:
  1. `_router_logits_kernel` (moe_triton): fp32 router logits, E / BLOCK_E programs per token (64 at Nano);
  2. `_small_up_kernel`: one program per (token, column tile, slot); each recomputes its token's top-k choice
     from the logits (a few hundred bytes; `topk_choice`, the router kernel's own code), streams its expert's
     [BLOCK_N, D] weight rows and writes relu2(x @ W^T) for its pair; the tile-0 programs store the choice;
  3. `_small_down_kernel`: one program per (token, column tile, slot) streams its expert's rows and stores
     its rounded, routing-weighted product; the last of a tile's slots to arrive (an arrival count, zeroed by
     the up kernel and reset after use) adds them in slot order with the shared-expert output: no combine
     launch, deterministic, and autotuning can rerun it.
The down programs stream their weight rows through a software-pipelined tl.dot loop (the activation row padded
to 16 rows), as the skinny projections do.
The shared expert's chunks are slots K.. (experts E..), so it streams in the same launches. Fixed shapes and no
host sync: CUDA-graph capturable. `moe_layer_triton` dispatches on the number of pairs (tokens x slots):
`SMALL_M_MAX_PAIRS` and below take this path, above the grouped GEMMs of `moe_triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.moe import SMALL_M_MAX_PAIRS, RouterSpec, uses_fp8_activations
from hybridserve.kernels.moe_router_triton import groups_fit, route_topk_triton, router_logits, topk_choice
from hybridserve.kernels.moe_triton import check_expert_inputs, moe_experts_triton
from hybridserve.kernels.triton_utils import (
    PERSIST_AUTOTUNE,
    cdiv,
    dot_launch,
    gemv_dot,
    gemv_fma,
    interpreting,
    last_to_arrive,
    next_pow2,
    pdl_gate,
    pdl_launch,
    pdl_trigger,
    pdl_wait,
    prefetch_l2,
)

# SMALL_M_MAX_PAIRS is kernels/moe.py's (its W8A8 rule reads it too), imported here so that tests and benchmarks can
# set it on this module, whose dispatch reads it


def _configs(tiles: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_N, BLOCK_K, warps, stages) on the GPU; one small config under the interpreter (tests)."""
    if interpreting():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in tiles]


# up: 6 + 2 experts x 1856 / BLOCK_N tiles, one program per (tile, slot), an FMA loop over [BLOCK_N, BLOCK_K]
# tiles (not software-pipelined: the bytes in flight are the tile times the programs an SM holds); down: 2688 /
# BLOCK_N tiles x 8 slots, one program per (tile, slot) streaming its [BLOCK_N, K] rows through a pipelined tl.dot
# loop (cp.async, STAGES - 1 tiles in flight), the slots' partials added by the last to arrive. On the H200 the
# pipelined loop for the up kernel too was 5 us faster for the layer alone but 1.8 us slower inside the 30B-A3B
# step (bench/results/h200/decode_step/), so up keeps the FMA loop.
_UP_TILES = [(16, 256, 4, 1), (16, 512, 4, 1), (32, 128, 4, 1), (32, 256, 4, 1), (64, 128, 4, 1), (32, 256, 8, 1),
             (32, 512, 8, 1), (64, 256, 8, 1)]
_DOWN_TILES = [(16, 128, 4, 3), (16, 256, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (16, 128, 4, 4), (32, 128, 4, 4),
               (64, 128, 4, 3), (16, 512, 4, 2), (32, 64, 4, 4)]


@triton.jit
def _expert_rows(w_ptr, ws_ptr, expert, num_routed, offs_n, w_e, w_n, ws_e, ws_n, SHARED: tl.constexpr):
    """Pointers to rows offs_n of `expert`'s weight: a routed expert's, or a shared chunk's (expert >= E)."""
    if SHARED:
        if expert >= num_routed:
            rows = ws_ptr + (expert - num_routed) * ws_e + offs_n.to(tl.int64)[:, None] * ws_n
        else:
            rows = w_ptr + expert * w_e + offs_n.to(tl.int64)[:, None] * w_n
    else:
        rows = w_ptr + expert * w_e + offs_n.to(tl.int64)[:, None] * w_n
    return rows


@lean_launch
@triton.autotune(configs=_configs(_UP_TILES), key=["N_OUT", "K", "WIDTH", "HAS_SCALE", "EARLY_SHARED"],
                 cache_results=PERSIST_AUTOTUNE)
@triton.jit
def _small_up_kernel(
    x_ptr, logits_ptr, bias_ptr, w_ptr, ws_ptr, scale_ptr, h_ptr, ids_ptr, weights_ptr, arrive_ptr,
    E, N_OUT, K, scaling, x_m, w_e, w_n, ws_e, ws_n, n_arrive,
    TOP_K: tl.constexpr, WIDTH: tl.constexpr, K_BLOCK: tl.constexpr, N_GROUP: tl.constexpr,
    PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr,
    HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EARLY_SHARED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """h[t * WIDTH + j, n] = relu2(x[t] . W[e_tj, n] * scale[e_tj, n]) for one (token t, column tile, slot j).
    A shared-expert slot's expert does not depend on the router: under PDL it prefetches its rows' first 1024
    columns into L2 before waiting on the router kernel, or, with EARLY_SHARED, computes its whole product
    before the wait (x was written before the router kernel's own wait returned, so it is complete) and takes the
    first slots of the launch order, so those programs run while the router kernel computes. The down kernel may
    launch only when a program's work is done (`pdl_trigger` last): launched at the gate, its programs waited
    resident through this kernel and took 27.4 instead of 25.5 us per 30B-A3B layer (bench/results/h200/decode_step/)."""
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    if EARLY_SHARED:
        slot = (slot + TOP_K) % WIDTH  # the shared chunks first: the GPU dispatches programs in launch order
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_OUT
    x_row = x_ptr + token * x_m
    ahead = EARLY_SHARED and slot >= TOP_K
    h = tl.zeros([BLOCK_N], dtype=tl.float32)
    if ahead:
        h = gemv_fma(x_row, ws_ptr + (slot - TOP_K) * ws_e + offs_n.to(tl.int64)[:, None] * ws_n, n_ok, K,
                  BLOCK_N, BLOCK_K)
    elif USE_PDL and SHARED:
        if slot >= TOP_K:
            rows = tl.minimum(offs_n, N_OUT - 1)
            lines = tl.minimum(tl.arange(0, 16) * 64, K - 1)
            prefetch_l2(ws_ptr + (slot - TOP_K) * ws_e + rows.to(tl.int64)[:, None] * ws_n + lines[None, :])
    pdl_wait(USE_PDL)
    chosen, weight = topk_choice(logits_ptr, bias_ptr, token, E, scaling, TOP_K, K_BLOCK, N_GROUP, PER_GROUP,
                                 TOPK_GROUP, NORM, SHARED)
    slots = tl.arange(0, K_BLOCK)
    mine = slots == slot
    if pid_n == 0:
        tl.store(ids_ptr + token * WIDTH + slots, chosen, mask=mine)
        tl.store(weights_ptr + token * WIDTH + slots, weight, mask=mine)
        if slot == 0:  # the down kernel's arrival counts for this token start at zero
            for a0 in range(0, n_arrive, 256):
                offs_a = a0 + tl.arange(0, 256)
                tl.store(arrive_ptr + token * n_arrive + offs_a, tl.zeros([256], dtype=tl.int32), mask=offs_a < n_arrive)
    if not ahead:
        expert = tl.sum(tl.where(mine, chosen, 0), 0)
        w_rows = _expert_rows(w_ptr, ws_ptr, expert, E, offs_n, w_e, w_n, ws_e, ws_n, SHARED)
        h = gemv_fma(x_row, w_rows, n_ok, K, BLOCK_N, BLOCK_K)
        if HAS_SCALE:
            h *= tl.load(scale_ptr + expert * N_OUT + offs_n, mask=n_ok, other=0.0)
    h = tl.maximum(h.to(h_ptr.dtype.element_ty).to(tl.float32), 0.0)  # relu2 of the rounded projection
    tl.store(h_ptr + (token * WIDTH + slot) * N_OUT + offs_n, (h * h).to(h_ptr.dtype.element_ty), mask=n_ok)
    pdl_trigger(USE_PDL)


@lean_launch
@triton.autotune(configs=_configs(_DOWN_TILES), key=["N_OUT", "K", "WIDTH", "HAS_SCALE", "HAS_SHARED_OUT"],
                 cache_results=PERSIST_AUTOTUNE)
@triton.jit
def _small_down_kernel(
    h_ptr, ids_ptr, weights_ptr, w_ptr, ws_ptr, scale_ptr, shared_ptr, out_ptr, part_ptr, arrive_ptr,
    E, N_OUT, K, w_e, w_n, ws_e, ws_n, out_m, n_arrive,
    WIDTH: tl.constexpr, SHARED: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SHARED_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t, n] = round(sum_j w_tj * round(h[t * WIDTH + j] . W[e_tj, n] * scale)) (+ shared_out[t, n]): each
    pair's product rounds to the activation dtype before its routing weight, the sum is fp32 (slot order) and
    rounds once, as transformers' experts (and `moe_experts_ref`) compute it. Program (t, column tile, slot j)
    stores w_tj * round(product) in part_ptr; the last of the token's WIDTH programs of the tile to arrive adds
    them in slot order (deterministic) and writes out."""
    pdl_gate(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_OUT
    expert = tl.load(ids_ptr + token * WIDTH + slot)
    w_rows = _expert_rows(w_ptr, ws_ptr, expert, E, offs_n, w_e, w_n, ws_e, ws_n, SHARED)
    acc = gemv_dot(h_ptr + (token * WIDTH + slot) * K, w_rows, n_ok, K, BLOCK_N, BLOCK_K, DOT_PRECISION, DOT_UPCAST)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * N_OUT + offs_n, mask=n_ok, other=0.0)
    route_w = tl.load(weights_ptr + token * WIDTH + slot)
    part = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * route_w
    parts = part_ptr + token * WIDTH * N_OUT + offs_n  # this token's [WIDTH, N_OUT] partials, this tile
    tl.store(parts + slot * N_OUT, part, mask=n_ok)
    if last_to_arrive(arrive_ptr + token * n_arrive + pid_n, WIDTH):
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            total += tl.load(parts + j * N_OUT, mask=n_ok, other=0.0, cache_modifier=".cg")
        out = total.to(out_ptr.dtype.element_ty)
        if HAS_SHARED_OUT:
            shared = tl.load(shared_ptr + token * out_m + offs_n, mask=n_ok, other=0.0)
            out = (out.to(tl.float32) + shared.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + token * out_m + offs_n, out, mask=n_ok)
        tl.atomic_xchg(arrive_ptr + token * n_arrive + pid_n, 0)  # ready for a rerun (the autotuner's)


def moe_small_triton(
    x: torch.Tensor,  # [N, hidden] router input
    router_weight: torch.Tensor,  # [E, hidden]
    correction_bias: torch.Tensor,  # [E]
    spec: RouterSpec,
    w_up: torch.Tensor,  # [E, I, D]
    w_down: torch.Tensor,  # [E, D, I]
    up_scale: torch.Tensor | None,  # [E, I] fp32 (fp8 weights)
    down_scale: torch.Tensor | None,  # [E, D]
    expert_x: torch.Tensor,  # [N, D] expert input (x, or its latent projection)
    shared_out: torch.Tensor | None,  # [N, D]
    shared_up: torch.Tensor | None,  # [S * I, D], S = spec.num_shared
    shared_down: torch.Tensor | None,  # [D, S * I]
) -> torch.Tensor:
    """The small-M layer (see the module docstring) -> [N, D] in expert_x's dtype. Inputs checked by the caller."""
    n, d = expert_x.shape
    num_experts, inter = w_up.shape[0], w_up.shape[1]
    width = spec.top_k + spec.num_shared
    logits = router_logits(x, router_weight)  # [N, E] fp32
    bias = correction_bias.float().contiguous()
    ids = torch.empty(n, width, dtype=torch.int64, device=x.device)
    weights = torch.empty(n, width, dtype=torch.float32, device=x.device)
    hidden = torch.empty(n * width, inter, dtype=expert_x.dtype, device=x.device)
    fused = spec.num_shared > 0
    up_s = shared_up if fused and shared_up is not None else w_up
    down_s = shared_down if fused and shared_down is not None else w_down
    scale_dummy = weights  # never read without HAS_SCALE
    pdl = pdl_launch(x.device)

    n_arrive = cdiv(d, 16)  # per token, one count per down column tile (BLOCK_N >= 16); zeroed by the up kernel
    arrivals = torch.empty(n, n_arrive, dtype=torch.int32, device=x.device)
    partials = torch.empty(n, width, d, dtype=torch.float32, device=x.device)

    def up_grid(meta: dict) -> tuple[int, int, int]:
        return (n, cdiv(inter, meta["BLOCK_N"]), width)

    _small_up_kernel[up_grid](
        expert_x, logits, bias, w_up, up_s, up_scale if up_scale is not None else scale_dummy, hidden, ids, weights,
        arrivals, num_experts, inter, d, float(spec.routed_scaling_factor), expert_x.stride(0), w_up.stride(0),
        w_up.stride(1), inter * d if fused else 0, d if fused else 0, n_arrive,
        TOP_K=spec.top_k, WIDTH=width, K_BLOCK=next_pow2(width), N_GROUP=spec.n_group,
        PER_GROUP=num_experts // spec.n_group, TOPK_GROUP=spec.topk_group, NORM=spec.norm_topk_prob,
        SHARED=spec.num_shared, HAS_SCALE=up_scale is not None,
        # the shared chunks compute ahead of the router wait (the 30B-A3B batch-1 step's router wait 118 -> 88 us on
        # the H200): with fused shared experts in half precision
        EARLY_SHARED=fused and up_scale is None, **pdl,
    )
    out = torch.empty(n, d, dtype=expert_x.dtype, device=x.device)

    def down_grid(meta: dict) -> tuple[int, int, int]:
        return (n, cdiv(d, meta["BLOCK_N"]), width)

    _small_down_kernel[down_grid](
        hidden, ids, weights, w_down, down_s, down_scale if down_scale is not None else scale_dummy,
        shared_out if shared_out is not None else out, out, partials, arrivals, num_experts, d, inter,
        w_down.stride(0), w_down.stride(1), inter if fused else 0, spec.num_shared * inter if fused else 0,
        out.stride(0), n_arrive, WIDTH=width, SHARED=fused, HAS_SCALE=down_scale is not None,
        HAS_SHARED_OUT=shared_out is not None, **dot_launch(expert_x.dtype), **pdl,
    )
    return out


def moe_layer_triton(
    x: torch.Tensor,  # [N, hidden]
    router_weight: torch.Tensor,  # [E, hidden]
    correction_bias: torch.Tensor,  # [E] fp32
    spec: RouterSpec,
    w_up: torch.Tensor,  # [E, I, D]
    w_down: torch.Tensor,  # [E, D, I]
    up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    expert_x: torch.Tensor | None = None,  # [N, D]: the experts' input when it is not x (latent MoE)
    shared_out: torch.Tensor | None = None,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    small_max_pairs: int | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """Same contract as `moe_layer_ref`: router + routed experts (+ shared) -> [N, D]. Up to `small_max_pairs`
    (default SMALL_M_MAX_PAIRS) pairs the three-launch small-M path (weight-only fp8), above it the grouped GEMMs
    (W8A8 with fp8_activations and fp8 experts, `uses_fp8_activations`)."""
    limit = SMALL_M_MAX_PAIRS if small_max_pairs is None else small_max_pairs
    xe = x if expert_x is None else expert_x
    n, width = x.shape[0], spec.top_k + spec.num_shared
    chunks = check_expert_inputs(xe, w_up, w_down, up_scale, shared_out, shared_up, shared_down)
    if chunks != spec.num_shared:
        raise ValueError(f"the router appends {spec.num_shared} shared-expert chunks, shared_up / shared_down hold "
                         f"{chunks}")
    if xe.shape[0] != n:
        raise ValueError(f"expert_x has {xe.shape[0]} rows, x has {n}")
    if not (0 < n * width <= limit and groups_fit(spec)):
        weights, ids = route_topk_triton(x, router_weight, correction_bias, spec)
        a8 = uses_fp8_activations(fp8_activations, w_up, n * width)
        return moe_experts_triton(xe, w_up, w_down, weights, ids, up_scale, down_scale, shared_out, shared_up,
                                  shared_down, fp8_activations=a8)
    shared_up, shared_down, shared_out = (t.contiguous() if t is not None else None
                                          for t in (shared_up, shared_down, shared_out))
    return moe_small_triton(x, router_weight, correction_bias, spec, w_up.contiguous(), w_down.contiguous(),
                            up_scale, down_scale, xe.contiguous(), shared_out, shared_up, shared_down)


__all__ = ["SMALL_M_MAX_PAIRS", "moe_layer_triton", "moe_small_triton"]
