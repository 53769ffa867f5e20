"""Replay method for speculative-decoding verify (TensorRT-LLM's design, our kernels): per slot one checkpoint
state plus the previous step's inputs; no per-token states are materialised.

At the start of a verify step the slot holds the state *before* the previous step's T tokens and a ring of
those tokens' x, B, processed dt and dA cumsum; `num_accepted` says how many of them were kept. The step
  1. precompute (grid B x groups x head blocks): CB = C B^T with one tl.dot per group, then for every head the
     processed new dt, its cumsum and CB scaled by exp(cum_t - cum_j) dt_j, causally masked; stores dt / cumsum
     / B for the next step;
  2. main (grid P-blocks x H x B): replays the accepted tokens into the state with one tl.dot, writes the
     state once, computes the T outputs with two tl.dots (C S^T decayed, CB_scaled x) and stores x;
  3. flips each slot's buffer index (B, dt, cumsum are double-buffered because heads share B).
State traffic per step: one read and (when something was accepted) one write, versus 1 + T for the
intermediate-state method. The torch reference is `replay_state_update.replay_state_update_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.replay_state_update import ReplayCache
from hybridserve.kernels.ssd_scan import NO_DT_LIMIT, DtLimit
from hybridserve.kernels.triton_utils import cdiv, check_same_device, finite_limits, next_pow2, process_dt_tl


@lean_launch
@triton.jit
def _replay_precompute_kernel(
    slots_ptr, dt_ptr, A_ptr, bias_ptr, B_ptr, C_ptr, cbs_ptr, buf_ptr, pB_ptr, pdt_ptr, pcum_ptr,
    T, H, N, heads_per_group, dt_lo, dt_hi,
    dt_b, dt_t, dt_h, B_b, B_t, B_g, B_n, C_b, C_t, C_g, C_n,
    pB_s, pB_i, pB_t, pB_g, pB_n, pdt_s, pdt_i, pdt_t, pdt_h,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    """Per (sequence, group, HEADS heads of the group): C B^T once for the group (it does not depend on the
    head), then every head's processed dt, cumsum and decay-scaled causal CBs, all heads at once as
    [HEADS, BLOCK_T, BLOCK_T] tensors."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    head_in_group = tl.program_id(2) * HEADS + tl.arange(0, HEADS)  # [HEADS]
    offs_h = g * heads_per_group + head_in_group
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    valid_t = (offs_t * 0 + slot) >= 0
    mask_t = (offs_t < T) & valid_t
    mask_h = head_in_group < heads_per_group
    slot = tl.maximum(slot, 0)
    wb = 1 - tl.load(buf_ptr + slot)  # write into the inactive buffer
    mask_tn = mask_t[:, None] & (offs_n < N)[None, :]
    Bm = tl.load(B_ptr + b * B_b + offs_t[:, None] * B_t + g * B_g + offs_n[None, :] * B_n, mask=mask_tn, other=0.0)
    Cm = tl.load(C_ptr + b * C_b + offs_t[:, None] * C_t + g * C_g + offs_n[None, :] * C_n, mask=mask_tn, other=0.0)
    cb = tl.dot(Cm.to(tl.float32), tl.trans(Bm.to(tl.float32)))  # [BLOCK_T, BLOCK_T]
    if tl.program_id(2) == 0:  # one program per group keeps B for the next step's replay
        tl.store(pB_ptr + slot * pB_s + wb * pB_i + offs_t[:, None] * pB_t + g * pB_g + offs_n[None, :] * pB_n,
                 Bm, mask=mask_tn)
    mask_ht = mask_h[:, None] & mask_t[None, :]  # [HEADS, BLOCK_T]
    bias = tl.zeros([HEADS], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * dt_b + offs_t[None, :] * dt_t + offs_h[:, None] * dt_h, mask=mask_ht,
                 other=0.0).to(tl.float32)
    dt = tl.where(mask_ht, process_dt_tl(dt, bias[:, None], DT_SOFTPLUS, HAS_LIMIT, dt_lo, dt_hi), 0.0)
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    cum = tl.cumsum(dt * A[:, None], axis=1)  # [HEADS, BLOCK_T]
    p_off = slot * pdt_s + wb * pdt_i + offs_t[None, :] * pdt_t + offs_h[:, None] * pdt_h
    tl.store(pdt_ptr + p_off, dt, mask=mask_ht)
    tl.store(pcum_ptr + p_off, cum, mask=mask_ht)
    causal = (offs_t[:, None] >= offs_t[None, :])[None, :, :]  # [1, BLOCK_T(t), BLOCK_T(j)]
    decay = tl.exp(tl.where(causal, cum[:, :, None] - cum[:, None, :], 0.0))  # [HEADS, BLOCK_T, BLOCK_T]
    cbs = tl.where(causal, cb[None, :, :] * decay * dt[:, None, :], 0.0)
    square = offs_t[:, None] * BLOCK_T + offs_t[None, :]
    base = cbs_ptr + ((b * H + offs_h) * BLOCK_T * BLOCK_T)[:, None, None]
    tl.store(base + square[None, :, :], cbs, mask=mask_h[:, None, None])


@lean_launch
@triton.jit
def _replay_main_kernel(
    state_ptr, slots_ptr, acc_ptr, x_ptr, z_ptr, C_ptr, D_ptr, y_ptr, cbs_ptr, buf_ptr,
    px_ptr, pB_ptr, pdt_ptr, pcum_ptr,
    T, H, P, N, heads_per_group,
    s_s, s_h, s_p, s_n, x_b, x_t, x_h, x_p, z_b, z_t, z_h, z_p, C_b, C_t, C_g, C_n, y_b, y_t, y_h, y_p,
    px_s, px_t, px_h, px_p, pB_s, pB_i, pB_t, pB_g, pB_n, pdt_s, pdt_i, pdt_t, pdt_h,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    DOT_OUT: tl.constexpr,
):
    pid_p = tl.program_id(0)
    h = tl.program_id(1)  # heads before sequences: programs launched together share one slot's state rows
    b = tl.program_id(2)
    g = h // heads_per_group
    offs_t = tl.arange(0, BLOCK_T)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    valid_p = (offs_p * 0 + slot) >= 0
    slot = tl.maximum(slot, 0)
    mask_p = (offs_p < P) & valid_p
    mask_t = offs_t < T
    mask_n = offs_n < N
    rb = tl.load(buf_ptr + slot)
    k = tl.load(acc_ptr + b)  # tokens of the previous step to replay, 0..T
    # every load first (state, last step's inputs, this step's inputs): they are independent, so they are all
    # in flight together, and one barrier then orders them before any store to the same addresses
    s_ptrs = state_ptr + slot * s_s + h * s_h + offs_p[:, None] * s_p + offs_n[None, :] * s_n
    state = tl.load(s_ptrs, mask=mask_p[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # [BP, BN]
    r_off = slot * pdt_s + rb * pdt_i + offs_t * pdt_t + h * pdt_h
    pcum = tl.load(pcum_ptr + r_off, mask=mask_t, other=0.0)
    pdt = tl.load(pdt_ptr + r_off, mask=mask_t, other=0.0)
    keep = offs_t < k
    px_ptrs = px_ptr + slot * px_s + offs_t[None, :] * px_t + h * px_h + offs_p[:, None] * px_p
    pxT = tl.load(px_ptrs, mask=mask_p[:, None] & keep[None, :], other=0.0).to(tl.float32)  # [BP, BT]
    pB = tl.load(pB_ptr + slot * pB_s + rb * pB_i + offs_t[:, None] * pB_t + g * pB_g + offs_n[None, :] * pB_n,
                 mask=keep[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # [BT, BN]
    w_off = slot * pdt_s + (1 - rb) * pdt_i + offs_t * pdt_t + h * pdt_h
    cum = tl.load(pcum_ptr + w_off, mask=mask_t, other=0.0)
    mask_pt = mask_p[:, None] & mask_t[None, :]
    xT = tl.load(x_ptr + b * x_b + offs_t[None, :] * x_t + h * x_h + offs_p[:, None] * x_p, mask=mask_pt,
                 other=0.0)  # [BP, BT]
    cbs_base = cbs_ptr + (b * H + h) * BLOCK_T * BLOCK_T
    if HAS_Z:
        zT = tl.load(z_ptr + b * z_b + offs_t[None, :] * z_t + h * z_h + offs_p[:, None] * z_p, mask=mask_pt,
                     other=0.0).to(tl.float32)
    # 1. replay the k accepted tokens of the previous step: S = exp(cum[k-1]) S + x^T (coef * B)
    cum_last = tl.sum(tl.where(offs_t == k - 1, pcum, 0.0), axis=0)
    coef = tl.where(keep, tl.exp(tl.where(keep, cum_last - pcum, 0.0)) * pdt, 0.0)  # [BLOCK_T]
    state = tl.exp(cum_last) * state + tl.dot(pxT, pB * coef[:, None])
    tl.debug_barrier()  # other layouts read these addresses above: all reads land before any write
    write_n = mask_n & (offs_n * 0 + k > 0)  # nothing accepted: the checkpoint stays as it is
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_p[:, None] & write_n[None, :])
    # 2. outputs of the T new tokens, transposed ([BP, BT]) so the state tile is the dot's natural A operand:
    #    y_t = exp(cum_t) S C_t + sum_j CBs[t, j] x_j (+ D x_t, z gate)
    x32 = xT.to(tl.float32)
    if DOT_OUT:
        CmT = tl.load(C_ptr + b * C_b + offs_t[None, :] * C_t + g * C_g + offs_n[:, None] * C_n,
                      mask=mask_n[:, None] & mask_t[None, :], other=0.0).to(tl.float32)  # [BN, BT]
        cbsT = tl.load(cbs_base + offs_t[None, :] * BLOCK_T + offs_t[:, None])  # [BT(j), BT(t)]
        yT = tl.dot(state, CmT) * tl.exp(cum)[None, :] + tl.dot(x32, cbsT)  # [BP, BT]
    else:  # T reductions over the state tile (memory-bound like the single-token update)
        yT = tl.zeros([BLOCK_P, BLOCK_T], dtype=tl.float32)
        for t in range(T):
            Ct = tl.load(C_ptr + b * C_b + t * C_t + g * C_g + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
            cum_t = tl.sum(tl.where(offs_t == t, cum, 0.0), axis=0)
            row = tl.load(cbs_base + t * BLOCK_T + offs_t)  # CBs[t, :] [BT]
            out_t = tl.sum(state * Ct[None, :], axis=1) * tl.exp(cum_t) + tl.sum(x32 * row[None, :], axis=1)
            yT = tl.where(offs_t[None, :] == t, out_t[:, None], yT)
    if HAS_D:
        yT += x32 * tl.load(D_ptr + h).to(tl.float32)
    if HAS_Z:
        yT = yT * zT * tl.sigmoid(zT)
    yT = tl.where(valid_p[:, None], yT, 0.0)
    tl.store(y_ptr + b * y_b + offs_t[None, :] * y_t + h * y_h + offs_p[:, None] * y_p,
             yT.to(y_ptr.dtype.element_ty), mask=(offs_p < P)[:, None] & mask_t[None, :])
    # 3. keep this step's x for the next replay (its old tile was read before the barrier above)
    tl.store(px_ptr + slot * px_s + offs_t[None, :] * px_t + h * px_h + offs_p[:, None] * px_p, xT, mask=mask_pt)


@lean_launch
@triton.jit
def _flip_kernel(slots_ptr, buf_ptr):
    slot = tl.load(slots_ptr + tl.program_id(0)).to(tl.int64)
    if slot >= 0:
        tl.store(buf_ptr + slot, 1 - tl.load(buf_ptr + slot))


def replay_state_update_triton(
    state_pool: torch.Tensor,  # [num_slots, H, P, N] checkpoint states (any strides)
    cache: ReplayCache,
    slots: torch.Tensor,  # [B] int, -1 = padded row
    num_accepted: torch.Tensor,  # [B] int, tokens of the previous step to replay (0..T)
    x: torch.Tensor,  # [B, T, H, P]
    dt: torch.Tensor,  # [B, T, H] raw
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [B, T, G, N]
    C: torch.Tensor,  # [B, T, G, N]
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_DT_LIMIT,
    z: torch.Tensor | None = None,  # [B, T, H, P]
    block_p: int = 32,  # 32 rows x 2 warps, outputs by tl.dot: best on H100 at batch 128 (bench/kernels/kernel_table.py sweep)
    num_warps: int = 2,
    dot_outputs: bool = True,  # outputs by tl.dot (True) or by T reductions over the state tile
) -> torch.Tensor:
    """One verify step by replay; returns y [B, T, H, P]. Updates state_pool and cache in place."""
    batch, tokens, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    if groups == 0 or heads % groups:
        raise ValueError(f"B and C have {groups} groups; it must divide the {heads} heads")
    if cache.prev_x.shape[1] != tokens:
        raise ValueError(f"replay cache holds {cache.prev_x.shape[1]} tokens per step, the step has {tokens}")
    check_same_device(state_pool, slots, num_accepted, x, dt, A, B, C, D, dt_bias, z, cache.prev_x)
    y = torch.empty_like(x)
    if batch == 0:
        return y
    block_t, block_n = max(16, next_pow2(tokens)), max(16, next_pow2(state))
    cbs = torch.empty(batch, heads, block_t, block_t, dtype=torch.float32, device=x.device)
    lo, hi, has_limit = finite_limits(dt_limit)
    heads_per_group = heads // groups
    heads_per_program = min(16, next_pow2(heads_per_group))
    _replay_precompute_kernel[(batch, groups, cdiv(heads_per_group, heads_per_program))](
        slots, dt, A, dt_bias if dt_bias is not None else A, B, C, cbs, cache.buf, cache.prev_B, cache.prev_dt,
        cache.prev_cum, tokens, heads, state, heads_per_group, lo, hi,
        *dt.stride(), *B.stride(), *C.stride(), *cache.prev_B.stride(), *cache.prev_dt.stride(),
        BLOCK_T=block_t, BLOCK_N=block_n, HEADS=heads_per_program, HAS_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit, num_warps=4,
    )
    zz = z if z is not None else x
    _replay_main_kernel[(cdiv(head_dim, block_p), heads, batch)](
        state_pool, slots, num_accepted, x, zz, C, D if D is not None else A, y, cbs, cache.buf,
        cache.prev_x, cache.prev_B, cache.prev_dt, cache.prev_cum,
        tokens, heads, head_dim, state, heads_per_group,
        *state_pool.stride(), *x.stride(), *zz.stride(), *C.stride(), *y.stride(),
        *cache.prev_x.stride(), *cache.prev_B.stride(), *cache.prev_dt.stride(),
        BLOCK_T=block_t, BLOCK_P=block_p, BLOCK_N=block_n, HAS_D=D is not None, HAS_Z=z is not None,
        DOT_OUT=dot_outputs, num_warps=num_warps,
    )
    _flip_kernel[(batch,)](slots, cache.buf)
    return y
