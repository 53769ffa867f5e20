"""Triton MoE layer for decode-sized batches in one launch: router, up and down as phases of one grid.

The small-M path (`moe_small_triton`) takes three launches per layer; at one token on an H200 each boundary
costs the layer a ramp and a tail (the router's ~4 us, up -> down ~2-3 us, bench/results/h200/session47). Here
the three kernels' programs are one grid whose programs take their roles in the order they start:

  [router tiles][shared-expert up tiles][routed up tiles][down tiles]

A program's role comes from a ticket (an atomic counter), not its program id, so every program with a smaller
ticket has already started when a program waits: a routed up program waits (spins) until every router program
has released its logits, a down program until every up program has released its h. Nothing waits on a program
that may not be resident, whatever order the hardware dispatches programs in, so the grid can be any size. The
shared-expert programs need no router and stream while it runs; a down program computes its token's choice and
sends its first weight columns to L2 while the up programs finish. The work of each phase is the small-M path's
own code (`router_tile`, `up_product`, `down_tile`), so the results are the same to the bit with the same tiles.
The last down program puts the counters back to zero, ready for the next call and CUDA-graph replays.

Under the interpreter the programs run one after another in ticket order, so no wait ever spins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridserve.env_switch import env_switch
from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.moe import RouterSpec
from hybridserve.kernels.moe_router_triton import router_blocks, router_tile, topk_choice
from hybridserve.kernels.moe_small_triton import down_tile, store_relu2, up_product
from hybridserve.kernels.triton_utils import (
    PERSIST_AUTOTUNE,
    cdiv,
    interpreting,
    next_pow2,
    pdl_launch,
    pdl_trigger,
    pdl_wait,
    prefetch_l2,
)

COUNTERS = 4  # ticket, router programs done, up programs done, down programs done


@dataclass(frozen=True)
class LaunchCounters:
    """The one-launch layer's counters, all 0 between calls. Owned by the layer that calls the kernel, never
    used by two launches in flight (a decode step runs on one stream)."""

    counts: torch.Tensor  # [COUNTERS] int32

    @classmethod
    def create(cls, device: torch.device) -> LaunchCounters:
        return cls(torch.zeros(COUNTERS, dtype=torch.int32, device=device))


def one_launch_enabled() -> bool:
    """Whether a layer holding LaunchCounters takes the one-launch path (default) rather than three launches
    (HYBRIDSERVE_MOE_ONE_LAUNCH=0, for A/B runs)."""
    return env_switch("HYBRIDSERVE_MOE_ONE_LAUNCH", True)


def _configs() -> list[triton.Config]:
    """(up tile, down tile, warps): around the three-launch path's picks at Nano's shapes on the H200
    (up 32 x 256, down 8 x 128, 4 warps: bench/results/h200/decode_step_b1/moe_tile_sweep.json)."""
    if interpreting():
        return [triton.Config({"UP_N": 16, "UP_K": 16, "DN_N": 16, "DN_K": 16}, num_warps=4, num_stages=1)]
    tiles = [((32, 256), (8, 128), 4), ((32, 256), (8, 256), 4), ((16, 512), (8, 128), 4), ((64, 128), (8, 128), 4),
             ((32, 256), (4, 512), 4), ((32, 256), (16, 128), 8), ((64, 256), (16, 256), 8), ((32, 512), (8, 256), 8)]
    return [triton.Config({"UP_N": un, "UP_K": uk, "DN_N": dn, "DN_K": dk}, num_warps=w, num_stages=1)
            for (un, uk), (dn, dk), w in tiles]


@triton.jit
def _wait_for(count_ptr, target):
    """Spin until *count_ptr >= target; acquire, then a barrier: every thread of the program sees the writes
    released before those increments."""
    seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _arrive(count_ptr):
    """Count this program's phase as done: a barrier (every thread's stores are issued), then a release
    increment. -> the count before it."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="acq_rel")


@lean_launch
@triton.autotune(configs=_configs(), key=["n_tokens", "E", "HIDDEN", "N_UP", "D", "WIDTH", "HAS_SCALE",
                                          "HAS_SHARED_OUT"], cache_results=PERSIST_AUTOTUNE)
@triton.jit
def _moe_decode_kernel(
    x_ptr, xe_ptr, router_ptr, logits_ptr, bias_ptr, w_up_ptr, ws_up_ptr, up_scale_ptr, h_ptr,
    w_dn_ptr, ws_dn_ptr, dn_scale_ptr, shared_ptr, out_ptr, count_ptr,
    n_tokens, E, HIDDEN, N_UP, D, scaling, x_m, xe_m, out_m, wu_e, wu_n, wsu_e, wsu_n, wd_e, wd_n, wsd_e, wsd_n,
    TOP_K: tl.constexpr, WIDTH: tl.constexpr, K_BLOCK: tl.constexpr, N_GROUP: tl.constexpr,
    PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_SHARED_OUT: tl.constexpr, R_BLOCK_E: tl.constexpr, R_BLOCK_K: tl.constexpr,
    UP_N: tl.constexpr, UP_K: tl.constexpr, DN_N: tl.constexpr, DN_K: tl.constexpr, DN_LINES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program of the layer (module docstring): its ticket picks a router tile (BLOCK_E experts of a token's
    logits), an up tile (UP_N rows of one slot's h) or a down tile (DN_N columns of a token's output)."""
    ticket = tl.atomic_add(count_ptr, 1)
    r_tiles = tl.cdiv(E, R_BLOCK_E)
    n_router = n_tokens * r_tiles
    up_tiles = tl.cdiv(N_UP, UP_N)
    n_shared = n_tokens * up_tiles * SHARED
    n_up = n_tokens * up_tiles * WIDTH
    if ticket < n_router:
        token = (ticket // r_tiles).to(tl.int64)
        offs_e = (ticket % r_tiles) * R_BLOCK_E + tl.arange(0, R_BLOCK_E)
        if USE_PDL:  # the router rows head for L2 while the kernel before (which wrote x) finishes
            lines = tl.minimum(tl.arange(0, (R_BLOCK_K + 63) // 64) * 64, HIDDEN - 1)
            prefetch_l2(router_ptr + tl.minimum(offs_e, E - 1).to(tl.int64)[:, None] * HIDDEN + lines[None, :])
        pdl_wait(USE_PDL)
        router_tile(x_ptr, router_ptr, logits_ptr, token, offs_e, E, HIDDEN, x_m, R_BLOCK_E, R_BLOCK_K)
        _arrive(count_ptr + 1)
    elif ticket < n_router + n_up:
        u = ticket - n_router
        if u < n_shared:  # a shared-expert chunk: slot TOP_K + c, expert E + c, no router needed
            token = (u // (up_tiles * SHARED)).to(tl.int64)
            slot = TOP_K + (u % (up_tiles * SHARED)) // up_tiles
            pid_n = u % up_tiles
        else:  # per token: slot after slot, each slot's tiles in row order
            v = u - n_shared
            token = (v // (up_tiles * TOP_K)).to(tl.int64)
            slot = (v % (up_tiles * TOP_K)) // up_tiles
            pid_n = v % up_tiles
        offs_n = pid_n * UP_N + tl.arange(0, UP_N)
        n_ok = offs_n < N_UP
        pdl_wait(USE_PDL)
        expert = (E + slot - TOP_K).to(tl.int64)
        if u >= n_shared:
            _wait_for(count_ptr + 1, n_router)
            chosen, _ = topk_choice(logits_ptr, bias_ptr, token, E, scaling, TOP_K, K_BLOCK, N_GROUP, PER_GROUP,
                                    TOPK_GROUP, NORM, SHARED)
            expert = tl.sum(tl.where(tl.arange(0, K_BLOCK) == slot, chosen, 0), 0)
        h = up_product(xe_ptr + token * xe_m, w_up_ptr, ws_up_ptr, up_scale_ptr, expert, E, N_UP, D, offs_n, n_ok,
                       wu_e, wu_n, wsu_e, wsu_n, SHARED, HAS_SCALE, UP_N, UP_K)
        store_relu2(h, h_ptr + (token * WIDTH + slot) * N_UP + offs_n, n_ok)
        _arrive(count_ptr + 2)
    else:
        dn_tiles = tl.cdiv(D, DN_N)
        d = ticket - n_router - n_up
        token = (d // dn_tiles).to(tl.int64)
        pid_n = d % dn_tiles
        pdl_wait(USE_PDL)
        _wait_for(count_ptr + 1, n_router)
        experts, route_w = topk_choice(logits_ptr, bias_ptr, token, E, scaling, TOP_K, K_BLOCK, N_GROUP, PER_GROUP,
                                       TOPK_GROUP, NORM, SHARED)
        if USE_PDL:  # the tile's first weight columns of every slot head for L2 while the up programs finish
            rows = tl.minimum(pid_n * DN_N + tl.arange(0, DN_N), D - 1).to(tl.int64)[None, :, None]
            lines = tl.minimum(tl.arange(0, DN_LINES) * 64, N_UP - 1)[None, None, :]
            routed = w_dn_ptr + (tl.minimum(experts, E - 1) * wd_e)[:, None, None] + rows * wd_n
            if SHARED:
                chunk = ws_dn_ptr + (tl.maximum(experts - E, 0) * wsd_e)[:, None, None] + rows * wsd_n
                routed = tl.where((experts >= E)[:, None, None], chunk, routed)
            prefetch_l2(routed + lines)
        _wait_for(count_ptr + 2, n_up)
        down_tile(h_ptr, experts, route_w, w_dn_ptr, ws_dn_ptr, dn_scale_ptr, shared_ptr, out_ptr, token, pid_n, E,
                  D, N_UP, wd_e, wd_n, wsd_e, wsd_n, out_m, WIDTH, K_BLOCK, SHARED, HAS_SCALE, HAS_SHARED_OUT, DN_N,
                  DN_K, True)
        if _arrive(count_ptr + 3) == n_tokens * dn_tiles - 1:  # the last program: every other has passed its waits
            tl.store(count_ptr + tl.arange(0, 4), tl.zeros([4], dtype=tl.int32))
    pdl_trigger(USE_PDL)


def moe_decode_triton(
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
    counters: LaunchCounters,
) -> torch.Tensor:
    """The layer in one launch (module docstring) -> [N, D] in expert_x's dtype; the same contract and bits as
    `moe_small_triton`. Inputs checked by the caller, apart from the counters."""
    counts = counters.counts
    if counts.shape != (COUNTERS,) or counts.dtype != torch.int32 or counts.device != x.device:
        raise ValueError(f"counters must be int32 [{COUNTERS}] on {x.device} (LaunchCounters.create), got "
                         f"{counts.dtype} {tuple(counts.shape)} on {counts.device}")
    n, d = expert_x.shape
    num_experts, inter = w_up.shape[0], w_up.shape[1]
    hidden = x.shape[1]
    width = spec.top_k + spec.num_shared
    x, router_weight = x.contiguous(), router_weight.contiguous()
    logits = torch.empty(n, num_experts, dtype=torch.float32, device=x.device)
    hidden_h = torch.empty(n * width, inter, dtype=expert_x.dtype, device=x.device)
    out = torch.empty(n, d, dtype=expert_x.dtype, device=x.device)
    fused = spec.num_shared > 0
    up_s = shared_up if fused and shared_up is not None else w_up
    down_s = shared_down if fused and shared_down is not None else w_down
    r_block_e, r_block_k = router_blocks(hidden)
    if n == 0:
        return out

    def grid(meta: dict) -> tuple[int]:
        return (n * (cdiv(num_experts, r_block_e) + cdiv(inter, meta["UP_N"]) * width + cdiv(d, meta["DN_N"])),)

    _moe_decode_kernel[grid](
        x, expert_x, router_weight, logits, correction_bias.float().contiguous(), w_up, up_s,
        up_scale if up_scale is not None else logits, hidden_h, w_down, down_s,
        down_scale if down_scale is not None else logits, shared_out if shared_out is not None else out, out,
        counts, n, num_experts, hidden, inter, d, float(spec.routed_scaling_factor), x.stride(0), expert_x.stride(0),
        out.stride(0), w_up.stride(0), w_up.stride(1), inter * d if fused else 0, d if fused else 0,
        w_down.stride(0), w_down.stride(1), inter if fused else 0, spec.num_shared * inter if fused else 0,
        TOP_K=spec.top_k, WIDTH=width, K_BLOCK=next_pow2(width), N_GROUP=spec.n_group,
        PER_GROUP=num_experts // spec.n_group, TOPK_GROUP=spec.topk_group, NORM=spec.norm_topk_prob,
        SHARED=spec.num_shared, HAS_SCALE=up_scale is not None, HAS_SHARED_OUT=shared_out is not None,
        R_BLOCK_E=r_block_e, R_BLOCK_K=r_block_k, DN_LINES=16, **pdl_launch(x.device),
    )
    return out


__all__ = ["COUNTERS", "LaunchCounters", "moe_decode_triton", "one_launch_enabled"]
