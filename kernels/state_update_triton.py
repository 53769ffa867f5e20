"""Triton selective state update: one token (decode) or T tokens (verify, intermediate-state method).

One program owns a [BLOCK_P, N] tile of one head's state for one sequence, keeps it in registers across the T
tokens and writes it back once (plus once per token into `intermediate_states` when asked). The state pool is
read through its strides, so the strided per-layer views of the request-major cache work without copies.
References and the contract: `hybridserve.kernels.state_update`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.ssd_scan import NO_DT_LIMIT, DtLimit
from hybridserve.kernels.triton_utils import (
    cdiv,
    check_same_device,
    finite_limits,
    next_pow2,
    pdl_gate,
    pdl_launch,
    process_dt_tl,
)


@lean_launch
@triton.jit
def _state_update_kernel(
    state_ptr, slots_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, z_ptr, y_ptr, inter_ptr,
    T, P, N, heads_per_group, dt_lo, dt_hi,
    s_slot, s_h, s_p, s_n,  # state pool strides
    x_b, x_t, x_h, x_p,  # x / z / y strides (z and y are made to share x's layout by the launcher)
    z_b, z_t, z_h, z_p,
    y_b, y_t, y_h, y_p,
    dt_b, dt_t, dt_h,
    B_b, B_t, B_g, B_n,
    C_b, C_t, C_g, C_n,
    i_b, i_t, i_h, i_p, i_n,  # intermediate states strides
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, HAS_INTER: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, WRITE_FINAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_gate(USE_PDL)
    # heads vary faster than sequences across the grid: programs launched together stream through one slot's
    # contiguous [H, P, N] state instead of touching every slot of the batch at once (bench/results/h100)
    h = tl.program_id(1)
    b = tl.program_id(2)
    g = h // heads_per_group
    slot = tl.load(slots_ptr + b).to(tl.int64)
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h).to(tl.float32)
    D = 0.0
    if HAS_D:
        D = tl.load(D_ptr + h).to(tl.float32)
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < N
    for tile in tl.static_range(TILES):  # TILES row blocks per program share the per-(b, h) set-up above
        _update_tile(
            state_ptr, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, y_ptr, inter_ptr, slot, b, h, g,
            (tl.program_id(0) * TILES + tile) * BLOCK_P, offs_n, mask_n, A, bias, D, T, P, dt_lo, dt_hi,
            s_slot, s_h, s_p, s_n, x_b, x_t, x_h, x_p, z_b, z_t, z_h, z_p, y_b, y_t, y_h, y_p, dt_b, dt_t, dt_h,
            B_b, B_t, B_g, B_n, C_b, C_t, C_g, C_n, i_b, i_t, i_h, i_p, i_n,
            BLOCK_P, HAS_D, HAS_Z, HAS_INTER, DT_SOFTPLUS, HAS_LIMIT, WRITE_FINAL,
        )


@triton.jit
def _update_tile(
    state_ptr, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, y_ptr, inter_ptr, slot, b, h, g, p0, offs_n, mask_n,
    A, bias, D, T, P, dt_lo, dt_hi,
    s_slot, s_h, s_p, s_n, x_b, x_t, x_h, x_p, z_b, z_t, z_h, z_p, y_b, y_t, y_h, y_p, dt_b, dt_t, dt_h,
    B_b, B_t, B_g, B_n, C_b, C_t, C_g, C_n, i_b, i_t, i_h, i_p, i_n,
    BLOCK_P: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_INTER: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, WRITE_FINAL: tl.constexpr,
):
    """Rows p0 .. p0+BLOCK_P of one (sequence, head) state through the T tokens."""
    offs_p = p0 + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    mask_p = offs_p < P
    valid = (offs_p * 0 + slot) >= 0  # [BLOCK_P]; padded rows (slot -1) output zeros, touch no state
    slot = tl.maximum(slot, 0)
    y_base = y_ptr + b * y_b + h * y_h + offs_p * y_p
    mask_pn = (mask_p & valid)[:, None] & mask_n[None, :]
    s_ptrs = state_ptr + slot * s_slot + h * s_h + offs_p[:, None] * s_p + offs_n[None, :] * s_n
    state = tl.load(s_ptrs, mask=mask_pn, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
    for t in range(T):
        x = tl.load(x_ptr + b * x_b + t * x_t + h * x_h + offs_p * x_p, mask=mask_p, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + b * dt_b + t * dt_t + h * dt_h).to(tl.float32)
        dt = process_dt_tl(dt, bias, DT_SOFTPLUS, HAS_LIMIT, dt_lo, dt_hi)
        Bv = tl.load(B_ptr + b * B_b + t * B_t + g * B_g + offs_n * B_n, mask=mask_n, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + b * C_b + t * C_t + g * C_g + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
        decay = tl.exp(dt * A)
        state = state * decay + (dt * x)[:, None] * Bv[None, :]
        y = tl.sum(state * Cv[None, :], axis=1)  # [BLOCK_P]
        if HAS_D:
            y += x * D
        if HAS_Z:
            z = tl.load(z_ptr + b * z_b + t * z_t + h * z_h + offs_p * z_p, mask=mask_p, other=0.0).to(tl.float32)
            y = y * z * tl.sigmoid(z)
        y = tl.where(valid, y, 0.0)
        tl.store(y_base + t * y_t, y.to(y_ptr.dtype.element_ty), mask=mask_p)
        if HAS_INTER:
            i_ptrs = inter_ptr + b * i_b + t * i_t + h * i_h + offs_p[:, None] * i_p + offs_n[None, :] * i_n
            tl.store(i_ptrs, state.to(inter_ptr.dtype.element_ty), mask=mask_pn)
    if WRITE_FINAL:
        tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_pn)


def _block_p(head_dim: int, state_size: int, batch: int, heads: int) -> int:
    """Rows of state per program: 16 (4-8 KiB of state) measured best at batch >= 32 on H200, fp32 and bf16."""
    if batch * heads < 512:  # small batch: smaller tiles for more programs in flight
        return min(8, next_pow2(head_dim))
    return min(16, next_pow2(head_dim))


def _warps(batch: int, tokens: int) -> int:
    """Warps per tile, measured on H200: 2 below 256 sequences; 1 from 256 single-token rows, 2-5 % faster there
    (16 x 128 tiles, fp32 and bf16 state, Nano-9B-v2 and 30B-A3B shapes; bench/results/h200/decode_step)."""
    return 1 if batch >= 256 and tokens == 1 else 2


def multi_token_state_update_triton(
    state_pool: torch.Tensor,  # [num_slots, H, P, N] (any strides)
    slots: torch.Tensor,  # [B] int, -1 = padded row
    x: torch.Tensor,  # [B, T, H, P]
    dt: torch.Tensor,  # [B, T, H] raw
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [B, T, G, N]
    C: torch.Tensor,  # [B, T, G, N]
    D: torch.Tensor | None = None,  # [H]
    dt_bias: torch.Tensor | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_DT_LIMIT,
    z: torch.Tensor | None = None,  # [B, T, H, P]
    intermediate_states: torch.Tensor | None = None,  # [B, T, H, P, N] out
    write_final_state: bool = True,
    out: torch.Tensor | None = None,  # [B, T, H, P] optional output buffer
    block_p: int | None = None,  # rows of state per tile (power of two); None: chosen by size
    num_warps: int | None = None,
    tiles: int = 1,  # row tiles per program (launch-shape sweeps)
) -> torch.Tensor:
    """Triton version of `multi_token_state_update_ref`; returns y [B, T, H, P] in x's dtype."""
    batch, tokens, heads, head_dim = x.shape
    num_groups, state_size = B.shape[2], B.shape[3]
    if heads % num_groups != 0:
        raise ValueError(f"heads {heads} must be a multiple of groups {num_groups}")
    if state_pool.shape[1:] != (heads, head_dim, state_size):
        raise ValueError(f"state pool shape {tuple(state_pool.shape)} does not match x {tuple(x.shape)} / B")
    check_same_device(state_pool, slots, x, dt, A, B, C, D, dt_bias, z, intermediate_states)
    y = torch.empty_like(x) if out is None else out
    if batch == 0 or tokens == 0:
        return y
    lo, hi, has_limit = finite_limits(dt_limit)
    zz = z if z is not None else x
    inter = intermediate_states if intermediate_states is not None else state_pool
    i_strides = intermediate_states.stride() if intermediate_states is not None else (0, 0, 0, 0, 0)
    block_p = _block_p(head_dim, state_size, batch, heads) if block_p is None else block_p
    if tiles <= 0:
        raise ValueError(f"tiles must be >= 1, got {tiles}")
    grid = (cdiv(head_dim, block_p * tiles), heads, batch)  # batch last: see the kernel
    _state_update_kernel[grid](
        state_pool, slots, x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A,
        zz, y, inter,
        tokens, head_dim, state_size, heads // num_groups, lo, hi,
        *state_pool.stride(), *x.stride(), *zz.stride(), *y.stride(), *dt.stride(), *B.stride(), *C.stride(),
        *i_strides,
        BLOCK_P=block_p, BLOCK_N=next_pow2(state_size), TILES=tiles,
        HAS_D=D is not None, HAS_BIAS=dt_bias is not None, HAS_Z=z is not None,
        HAS_INTER=intermediate_states is not None, DT_SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
        WRITE_FINAL=write_final_state, **pdl_launch(x.device),
        num_warps=num_warps or _warps(batch, tokens),
    )
    return y
