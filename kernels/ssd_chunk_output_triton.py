"""Triton output kernel of the varlen SSD scan, blocked: each logical chunk is walked in sub-blocks of BLOCK_M
tokens with the state carried in registers, so only the diagonal BLOCK_M x BLOCK_M block of C B^T is ever formed.

For sub-block m of a chunk, with S the state after the previous sub-block (the chunk's entry state for m = 0,
read from the buffer the state walk wrote) and cum the in-chunk cumsum of dt * A:
    y_t = exp(cum_t - cum_ref) C_t S^T + sum_{k in m, k <= t} exp(cum_t - cum_k) dt_k (C_t . B_k) x_k + D x_t
    S  <- exp(cum_end - cum_ref) S + sum_{k in m} exp(cum_end - cum_k) dt_k x_k B_k^T
Every exponent is <= 0 (cum is non-increasing), so nothing overflows. Compared with evaluating C B^T over the
whole chunk, this does O(chunk * BLOCK_M) instead of O(chunk^2) work on the decay matrix (exps, masks) and never
spends tl.dot work above the causal diagonal. One program per (head_dim tile, chunk, head).
Launched by `ssd_scan_triton.ssd_scan_varlen_triton`; the reference is `ssd_scan.ssd_scan_varlen_ref`.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.ssd_chunk_state_triton import segment_start_term
from hybridserve.kernels.triton_utils import PERSIST_AUTOTUNE, interpreting, next_pow2


def _output_configs() -> list[triton.Config]:
    """Autotune space on the GPU; one small config under the interpreter (tests)."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_P": 16}, num_warps=4, num_stages=1)]
    # no 32-row sub-blocks with num_stages=2: Triton 3.6 on the H100 miscompiles them (y off by ~8 % relative to
    # the reference at both real shapes; 64 and 128 rows with 2 stages are exact); `test_output_configs_gpu` checks
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_P": p}, num_warps=w, num_stages=s)
               for m in (32, 64) for p in (16, 32, 64) for w in (4, 8) for s in (1, 2) if m > 32 or s == 1]
    return configs + [triton.Config({"BLOCK_M": 128, "BLOCK_P": p}, num_warps=8, num_stages=2) for p in (32, 64)]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: Any) -> list[triton.Config]:
    """Fit the configs to the problem: BLOCK_M at most the chunk, BLOCK_P at most the padded head_dim."""
    chunk = int(kwargs.get("QBLOCK") or named_args.get("QBLOCK") or 16)
    full = max(16, next_pow2(int(named_args["P"])))
    kept = [triton.Config({"BLOCK_M": min(c.kwargs["BLOCK_M"], chunk), "BLOCK_P": min(c.kwargs["BLOCK_P"], full)},
                          num_warps=c.num_warps, num_stages=c.num_stages) for c in configs]
    return list({str(c): c for c in kept}.values())


@lean_launch
@triton.autotune(configs=_output_configs(), key=["P", "N", "CHUNK", "HAS_SEGMENTS"],
                 prune_configs_by={"early_config_prune": _prune},
                 cache_results=PERSIST_AUTOTUNE)
@triton.jit
def chunk_output_kernel(
    x_ptr, dtc_ptr, cum_ptr, B_ptr, C_ptr, D_ptr, states_ptr, corr_ptr, seg_decay_ptr, chunk_seg_ptr, y_ptr,
    chunk_start_ptr, chunk_len_ptr,
    P, N, H, NC, heads_per_group,
    x_t, x_h, x_p, B_t, B_g, B_n, C_t, C_g, C_n, y_t, y_h, y_p,
    CHUNK: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_D: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
):
    pid_p = tl.program_id(0)
    c = tl.program_id(1)
    h = tl.program_id(2)
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < P, offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    # the state entering the chunk, rows = head_dim, columns = state: [BLOCK_P, BLOCK_N] fp32
    state = tl.load(states_ptr + (c.to(tl.int64) * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :],
                    mask=mask_pn, other=0.0).to(tl.float32)
    if HAS_SEGMENTS:  # a later segment's walk started from zeros: add its decayed true start state
        state += segment_start_term(corr_ptr, seg_decay_ptr, chunk_seg_ptr, c, h, H, P, N, NC, offs_p[:, None],
                                    offs_n[None, :], mask_pn)
    D_h = 0.0
    if HAS_D:
        D_h = tl.load(D_ptr + h).to(tl.float32)
    row = (h.to(tl.int64) * NC + c) * QBLOCK  # this (head, chunk)'s dt / cumsum vectors (flat past the chunk end)
    x_base = x_ptr + start * x_t + h * x_h
    cum_ref = tl.full([], 0.0, tl.float32)
    for m0 in range(0, length, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < length
        cum_m = tl.load(cum_ptr + row + offs_m)  # [BLOCK_M]
        dt_m = tl.load(dtc_ptr + row + offs_m)  # 0 past the chunk end
        cum_end = tl.load(cum_ptr + row + m0 + BLOCK_M - 1)
        Cm = tl.load(C_ptr + (start + offs_m[:, None]) * C_t + g * C_g + offs_n[None, :] * C_n,
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_M, BLOCK_N]
        Bm = tl.load(B_ptr + (start + offs_m[:, None]) * B_t + g * B_g + offs_n[None, :] * B_n,
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_M, BLOCK_N]
        xm = tl.load(x_base + offs_m[:, None] * x_t + offs_p[None, :] * x_p,
                     mask=mask_m[:, None] & mask_p[None, :], other=0.0)  # [BLOCK_M, BLOCK_P]
        acc = tl.dot(Cm, tl.trans(state.to(Cm.dtype)), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_P]
        acc *= tl.exp(cum_m - cum_ref)[:, None]
        cb = tl.dot(Cm, tl.trans(Bm), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_M] the diagonal block
        causal = offs_m[:, None] >= offs_m[None, :]
        decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_m[None, :], -float("inf")))
        w = (cb * decay * dt_m[None, :]).to(xm.dtype)
        acc += tl.dot(w, xm, input_precision=DOT_PRECISION)
        if HAS_D:
            acc += xm.to(tl.float32) * D_h
        tl.store(y_ptr + (start + offs_m[:, None]) * y_t + h * y_h + offs_p[None, :] * y_p,
                 acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_p[None, :])
        if m0 + BLOCK_M < length:  # carry the state to the next sub-block (the walk already has the chunk end)
            xs = (xm.to(tl.float32) * (tl.exp(cum_end - cum_m) * dt_m)[:, None]).to(xm.dtype)  # [BLOCK_M, BLOCK_P]
            state = tl.exp(cum_end - cum_ref) * state + tl.dot(tl.trans(xs), Bm, input_precision=DOT_PRECISION)
            cum_ref = cum_end
