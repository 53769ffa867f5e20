"""Triton output kernel of the varlen SSD scan: y = exp(cum) * C S_in^T + (causal, decayed C B^T * dt) x + D x
per logical chunk, given the state entering each chunk (from `ssd_chunk_state_triton`).

The heads of one group share C and B, so one program owns (block of BLOCK_M rows of a chunk, chunk, HEADS
heads of one group): it computes C B^T for the whole chunk once with one tl.dot and keeps it in registers,
then for each of its heads applies that head's decay and dt and does the two output tl.dots. Compared with one
program per head reading a precomputed fp32 C B^T, this reads C and B once per HEADS heads and needs no
[chunks, G, Q, Q] buffer. Launched by `ssd_scan_triton.ssd_scan_varlen_triton`.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.ssd_chunk_state_triton import segment_start_term
from hybridserve.kernels.triton_utils import PERSIST_AUTOTUNE, interpreting, next_pow2


def _scan_configs() -> list[triton.Config]:
    """Autotune space on the GPU; one small config under the interpreter (tests)."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "HEADS": heads, "BLOCK_P": 16}, num_warps=4, num_stages=1)
                for heads in (2, 1)]
    # BLOCK_P 0 = the whole head_dim in one (power-of-two padded) tile; 16 / 32 loop over it (80 = 5 x 16)
    configs = [triton.Config({"BLOCK_M": m, "HEADS": heads, "BLOCK_P": p}, num_warps=4 if m == 64 else 8,
                             num_stages=2) for m in (64, 128) for heads in (1, 2, 4, 8) for p in (0, 16, 32)]
    return configs + [triton.Config({"BLOCK_M": 64, "HEADS": heads, "BLOCK_P": p}, num_warps=8, num_stages=2)
                      for heads in (4, 8) for p in (16, 32)]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: Any) -> list[triton.Config]:
    """Fit the configs to the problem: HEADS must divide the group's head count (HEADS=1 always does), BLOCK_M is
    capped at the chunk, BLOCK_P 0 becomes the whole (power-of-two padded) head_dim."""
    per_group = int(named_args["heads_per_group"])
    chunk = int(kwargs.get("QBLOCK") or named_args.get("QBLOCK") or 16)
    full = max(16, next_pow2(int(named_args["P"])))
    kept = [triton.Config({**c.kwargs, "BLOCK_M": min(c.kwargs["BLOCK_M"], chunk),
                           "BLOCK_P": c.kwargs["BLOCK_P"] or full}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in configs if per_group % c.kwargs["HEADS"] == 0]
    kept = list({str(c): c for c in kept}.values())
    return kept[:1] if interpreting() else kept  # the interpreter runs one config (HEADS=2 where it divides)


@lean_launch
@triton.autotune(configs=_scan_configs(), key=["P", "N", "CHUNK", "heads_per_group", "HAS_SEGMENTS"],
                 prune_configs_by={"early_config_prune": _prune},
                 cache_results=PERSIST_AUTOTUNE)
@triton.jit
def chunk_scan_kernel(
    x_ptr, dtc_ptr, cum_ptr, B_ptr, C_ptr, D_ptr, states_ptr, corr_ptr, seg_decay_ptr, chunk_seg_ptr, y_ptr,
    chunk_start_ptr, chunk_len_ptr,
    P, N, H, NC, heads_per_group,
    x_t, x_h, x_p, B_t, B_g, B_n, C_t, C_g, C_n, y_t, y_h, y_p,
    CHUNK: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr, HEADS: tl.constexpr, HAS_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr,  # BLOCK_P: head_dim tile, looped over P
):
    pid_m = tl.program_id(0)
    c = tl.program_id(1)
    head_blocks = heads_per_group // HEADS
    g = tl.program_id(2) // head_blocks
    h0 = g * heads_per_group + (tl.program_id(2) % head_blocks) * HEADS
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    m0 = pid_m * BLOCK_M
    if m0 < length:  # short chunks (a sequence's first or last) leave later row blocks idle
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, QBLOCK)  # every key of the chunk
        offs_n = tl.arange(0, BLOCK_N)
        mask_m, mask_k, mask_n = offs_m < length, offs_k < length, offs_n < N
        Cm = tl.load(C_ptr + (start + offs_m[:, None]) * C_t + g * C_g + offs_n[None, :] * C_n,
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_M, BLOCK_N]
        BkT = tl.load(B_ptr + (start + offs_k[None, :]) * B_t + g * B_g + offs_n[:, None] * B_n,
                      mask=mask_k[None, :] & mask_n[:, None], other=0.0)  # [BLOCK_N, QBLOCK]
        cb = tl.dot(Cm, BkT, input_precision=DOT_PRECISION)  # [BLOCK_M, QBLOCK] fp32, shared by the HEADS heads
        causal = (offs_m[:, None] >= offs_k[None, :]) & mask_k[None, :]
        for i in range(HEADS):
            h = h0 + i
            row = (h.to(tl.int64) * NC + c) * QBLOCK  # this (head, chunk)'s dt / cumsum vectors
            cum_m = tl.load(cum_ptr + row + offs_m, mask=offs_m < QBLOCK, other=0.0)  # [BLOCK_M]
            cum_k = tl.load(cum_ptr + row + offs_k)  # [QBLOCK]
            dt_k = tl.load(dtc_ptr + row + offs_k)
            decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_k[None, :], -float("inf")))
            w = cb * decay * dt_k[None, :]  # [BLOCK_M, QBLOCK]
            w = w.to(x_ptr.dtype.element_ty)
            x_base = x_ptr + start * x_t + h * x_h
            scale_m = tl.exp(cum_m)[:, None]
            D_h = 0.0
            if HAS_D:
                D_h = tl.load(D_ptr + h).to(tl.float32)
            for p0 in range(0, P, BLOCK_P):  # w and cb are reused by every head_dim tile
                offs_p = p0 + tl.arange(0, BLOCK_P)
                mask_p = offs_p < P
                S_in = tl.load(states_ptr + (c.to(tl.int64) * H + h) * P * N + offs_p[None, :] * N
                               + offs_n[:, None], mask=mask_p[None, :] & mask_n[:, None], other=0.0)  # [BN, BP]
                if HAS_SEGMENTS:  # a later segment's walk started from zeros: add its decayed true start state
                    S_in = (S_in.to(tl.float32) + segment_start_term(
                        corr_ptr, seg_decay_ptr, chunk_seg_ptr, c, h, H, P, N, NC, offs_p[None, :], offs_n[:, None],
                        mask_p[None, :] & mask_n[:, None])).to(S_in.dtype)
                xk = tl.load(x_base + offs_k[:, None] * x_t + offs_p[None, :] * x_p,
                             mask=mask_k[:, None] & mask_p[None, :], other=0.0)  # [QBLOCK, BLOCK_P]
                acc = tl.dot(Cm, S_in.to(Cm.dtype), input_precision=DOT_PRECISION) * scale_m  # [BLOCK_M, BLOCK_P]
                acc += tl.dot(w, xk, input_precision=DOT_PRECISION)
                if HAS_D:
                    xm = tl.load(x_base + offs_m[:, None] * x_t + offs_p[None, :] * x_p,
                                 mask=mask_m[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
                    acc += xm * D_h
                y_ptrs = y_ptr + (start + offs_m[:, None]) * y_t + h * y_h + offs_p[None, :] * y_p
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_p[None, :])
