"""Triton SSD chunked scan over packed variable-length sequences with chunk-aligned states.

Kernels over *logical chunks* (no chunk straddles two sequences; a resumed sequence's first chunk is short
so later chunk ends land on absolute multiples of chunk_size, exactly as the reference walks them):
  1. chunk cumsum: dt bias / softplus / limit and the in-chunk cumsum of dt * A, per (head, chunk).
  2. chunk states: one program per (head_dim block, sequence, head) walks the sequence's chunks in order
     from its initial state, S <- exp(sum dA) S + x^T (B dt exp(cum_end - cum)) (one tl.dot per chunk), and
     stores the state entering every chunk, the kept chunk-end states and the final state. The running
     state never leaves registers, so per-chunk local states cost no memory traffic.
  3. chunk C B^T once per (chunk, group) into a [chunks, G, Q, Q] fp32 buffer, shared by the group's heads.
  4. chunk scan: y = exp(cum) * C S_in^T + (causal, decayed C B^T * dt) x + D x.
Reference and contract: `hybridserve.kernels.ssd_scan.ssd_scan_varlen_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.ssd_scan import NO_DT_LIMIT, DtLimit, SSDScanOutput
from hybridserve.kernels.ssd_scan_meta import ChunkMeta, chunk_metadata
from hybridserve.kernels.triton_utils import check_same_device, finite_limits, interpreting, next_pow2, process_dt_tl


def _configs(space: list[dict], warps: list[int], stages: list[int]) -> list[triton.Config]:
    """Autotune configs on the GPU; one small config under the interpreter (tests)."""
    if interpreting():
        return [triton.Config(space[0], num_warps=4, num_stages=1)]
    return [triton.Config(kw, num_warps=w, num_stages=s) for kw in space for w in warps for s in stages]


@triton.jit
def _chunk_cumsum_kernel(
    dt_ptr, A_ptr, bias_ptr, dt_out_ptr, cum_ptr, chunk_start_ptr, chunk_len_ptr, H, NC, dt_lo, dt_hi, dt_t, dt_h,
    QBLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    """Processed dt and the in-chunk cumsum of dt * A for every (head, chunk): [H, NC, QBLOCK] fp32 each,
    with dt = 0 past the chunk's end so the cumsum stays flat there (its last entry is the chunk total)."""
    c = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_q = tl.arange(0, QBLOCK)
    mask_h = offs_h < H
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    mask = (offs_q < length)[:, None] & mask_h[None, :]
    dt = tl.load(dt_ptr + (start + offs_q[:, None]) * dt_t + offs_h[None, :] * dt_h, mask=mask, other=0.0)
    bias = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    dt = process_dt_tl(dt.to(tl.float32), bias[None, :], DT_SOFTPLUS, HAS_LIMIT, dt_lo, dt_hi)
    dt = tl.where(mask, dt, 0.0)  # [QBLOCK, BLOCK_H]
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    cum = tl.cumsum(dt * A[None, :], axis=0)
    out = (offs_h[None, :].to(tl.int64) * NC + c) * QBLOCK + offs_q[:, None]
    tl.store(dt_out_ptr + out, dt, mask=mask_h[None, :])
    tl.store(cum_ptr + out, cum, mask=mask_h[None, :])


@triton.autotune(
    configs=_configs(
        [{"BLOCK_P": 16}, {"BLOCK_P": 32}],
        [2, 4, 8],
        [1, 2, 3, 4],
    ),
    key=["P", "N", "CHUNK"],
)
@triton.jit
def _chunk_states_kernel(
    x_ptr, dtc_ptr, cum_ptr, B_ptr, init_ptr, states_ptr, final_ptr, kept_ptr,
    chunk_start_ptr, chunk_len_ptr, seq_chunk_ptr, keep_idx_ptr,
    P, N, H, NC, heads_per_group,
    x_t, x_h, x_p, B_t, B_g, B_n, i_s, i_h, i_p, i_n,
    CHUNK: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_INIT: tl.constexpr,
):
    """Per (head_dim block, sequence, head): walk the sequence's chunks in order from its initial state;
    store the state entering each chunk (x's dtype, for the scan), the kept chunk-end states and the final
    state (fp32). The running state stays in registers, so no per-chunk local states go through memory."""
    pid_p = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    g = h // heads_per_group
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_pn = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    tile = offs_p[:, None] * N + offs_n[None, :]  # [BLOCK_P, BLOCK_N] offsets in a contiguous [P, N] state
    if HAS_INIT:
        state = tl.load(init_ptr + tl.cast(s, tl.int64) * i_s + h * i_h + offs_p[:, None] * i_p
                        + offs_n[None, :] * i_n, mask=mask_pn, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    offs_q = tl.arange(0, QBLOCK)  # CHUNK padded to the 16 tl.dot needs
    c0 = tl.load(seq_chunk_ptr + s)
    c1 = tl.load(seq_chunk_ptr + s + 1)
    # chunks of one sequence are contiguous: the first may be short, the rest are CHUNK long (the last may be
    # short); computing starts from the loop index keeps the loads independent of earlier loads (pipelinable)
    begin = tl.load(chunk_start_ptr + c0, mask=c1 > c0, other=0).to(tl.int64)
    first = tl.load(chunk_len_ptr + c0, mask=c1 > c0, other=0)
    seq_len = tl.load(chunk_start_ptr + c1 - 1, mask=c1 > c0, other=0).to(tl.int64) - begin + tl.load(
        chunk_len_ptr + c1 - 1, mask=c1 > c0, other=0)
    for i in range(0, c1 - c0):
        offset = tl.where(i == 0, 0, first + (i - 1) * CHUNK).to(tl.int64)
        length = tl.minimum(tl.where(i == 0, first, CHUNK), seq_len - offset)
        start = begin + offset
        c = tl.cast(c0 + i, tl.int64)
        tl.store(states_ptr + (c * H + h) * P * N + tile, state.to(states_ptr.dtype.element_ty), mask=mask_pn)
        mask_q = offs_q < length
        row = (h * NC + c) * QBLOCK
        dt_q = tl.load(dtc_ptr + row + offs_q)
        cum_q = tl.load(cum_ptr + row + offs_q)
        total = tl.load(cum_ptr + row + QBLOCK - 1)
        scale = tl.exp(total - cum_q) * dt_q  # [QBLOCK] decay to the chunk end, times dt
        xT = tl.load(x_ptr + start * x_t + h * x_h + offs_p[:, None] * x_p + offs_q[None, :] * x_t,
                     mask=(offs_p < P)[:, None] & mask_q[None, :], other=0.0)  # [BLOCK_P, QBLOCK]
        Bq = tl.load(B_ptr + start * B_t + g * B_g + offs_q[:, None] * B_t + offs_n[None, :] * B_n,
                     mask=mask_q[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)  # [QBLOCK, BLOCK_N]
        state = tl.exp(total) * state + tl.dot(xT, (Bq * scale[:, None]).to(xT.dtype))
        k = tl.load(keep_idx_ptr + c)
        tl.store(kept_ptr + (tl.maximum(k, 0).to(tl.int64) * H + h) * P * N + tile, state,
                 mask=mask_pn & (offs_p * 0 + k >= 0)[:, None])
    tl.store(final_ptr + (tl.cast(s, tl.int64) * H + h) * P * N + tile, state, mask=mask_pn)


@triton.jit
def _chunk_cb_kernel(
    B_ptr, C_ptr, cb_ptr, chunk_start_ptr, chunk_len_ptr, N, G, B_t, B_g, B_n, C_t, C_g, C_n,
    CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
):
    """cb[c, g] = C_chunk B_chunk^T ([CHUNK, CHUNK] fp32, zero outside the chunk), once per group."""
    blocks = tl.cdiv(CHUNK, BLOCK)
    bm = tl.program_id(0) // blocks
    bk = tl.program_id(0) % blocks
    c = tl.program_id(1)
    g = tl.program_id(2)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_m = bm * BLOCK + tl.arange(0, BLOCK)
    offs_k = bk * BLOCK + tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK_N)
    Cm = tl.load(C_ptr + (start + offs_m[:, None]) * C_t + g * C_g + offs_n[None, :] * C_n,
                 mask=(offs_m < length)[:, None] & (offs_n < N)[None, :], other=0.0)
    BkT = tl.load(B_ptr + (start + offs_k[None, :]) * B_t + g * B_g + offs_n[:, None] * B_n,
                  mask=(offs_k < length)[None, :] & (offs_n < N)[:, None], other=0.0)
    cb = tl.dot(Cm, BkT)  # [BLOCK, BLOCK]
    base = cb_ptr + (tl.cast(c, tl.int64) * G + g) * CHUNK * CHUNK
    tl.store(base + offs_m[:, None] * CHUNK + offs_k[None, :], cb,
             mask=(offs_m < CHUNK)[:, None] & (offs_k < CHUNK)[None, :])


@triton.autotune(
    configs=_configs(
        [{"BLOCK_M": 64, "BLOCK_P": 128, "BLOCK_K": 32}, {"BLOCK_M": 64, "BLOCK_P": 128, "BLOCK_K": 64},
         {"BLOCK_M": 128, "BLOCK_P": 128, "BLOCK_K": 32}, {"BLOCK_M": 128, "BLOCK_P": 64, "BLOCK_K": 32},
         {"BLOCK_M": 64, "BLOCK_P": 64, "BLOCK_K": 64}, {"BLOCK_M": 64, "BLOCK_P": 64, "BLOCK_K": 32}],
        [4, 8],
        [2, 3, 4],
    ),
    key=["P", "N", "CHUNK"],
)
@triton.jit
def _chunk_scan_kernel(
    x_ptr, dtc_ptr, cum_ptr, cb_ptr, C_ptr, D_ptr, states_ptr, y_ptr, chunk_start_ptr, chunk_len_ptr,
    P, N, H, G, NC, heads_per_group,
    x_t, x_h, x_p, C_t, C_g, C_n, y_t, y_h, y_p,
    CHUNK: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, HAS_D: tl.constexpr,
):
    num_p_blocks = tl.cdiv(P, BLOCK_P)
    pid_m = tl.program_id(0) // num_p_blocks
    pid_p = tl.program_id(0) % num_p_blocks
    c = tl.program_id(1)
    h = tl.program_id(2)
    g = h // heads_per_group
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    m0 = pid_m * BLOCK_M
    row = (h.to(tl.int64) * NC + c) * QBLOCK  # this (head, chunk)'s dt / cumsum vectors
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    cum_m = tl.load(cum_ptr + row + offs_m, mask=offs_m < QBLOCK, other=0.0)  # [BLOCK_M]
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < P, offs_n < N
    Cm = tl.load(C_ptr + (start + offs_m[:, None]) * C_t + g * C_g + offs_n[None, :] * C_n,
                 mask=mask_m[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_M, BLOCK_N]
    S_in = tl.load(states_ptr + (tl.cast(c, tl.int64) * H + h) * P * N + offs_p[None, :] * N + offs_n[:, None],
                   mask=mask_p[None, :] & mask_n[:, None], other=0.0)  # [BLOCK_N, BLOCK_P] fp32
    acc = tl.dot(Cm, S_in.to(Cm.dtype)) * tl.exp(cum_m)[:, None]  # [BLOCK_M, BLOCK_P]
    x_base = x_ptr + start * x_t + h * x_h
    cb_base = cb_ptr + (tl.cast(c, tl.int64) * G + g) * CHUNK * CHUNK
    hi = tl.minimum(m0 + BLOCK_M, length)
    for k0 in range(0, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < length
        dt_k = tl.load(dtc_ptr + row + offs_k, mask=offs_k < QBLOCK, other=0.0)
        cum_k = tl.load(cum_ptr + row + offs_k, mask=offs_k < QBLOCK, other=0.0)
        cb = tl.load(cb_base + offs_m[:, None] * CHUNK + offs_k[None, :],
                     mask=(offs_m < CHUNK)[:, None] & (offs_k < CHUNK)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        causal = (offs_m[:, None] >= offs_k[None, :]) & mask_k[None, :]
        decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_k[None, :], -float("inf")))
        w = cb * decay * dt_k[None, :]
        xk = tl.load(x_base + offs_k[:, None] * x_t + offs_p[None, :] * x_p,
                     mask=mask_k[:, None] & mask_p[None, :], other=0.0)  # [BLOCK_K, BLOCK_P]
        acc += tl.dot(w.to(xk.dtype), xk)
    if HAS_D:
        xm = tl.load(x_base + offs_m[:, None] * x_t + offs_p[None, :] * x_p,
                     mask=mask_m[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
        acc += xm * tl.load(D_ptr + h).to(tl.float32)
    y_ptrs = y_ptr + (start + offs_m[:, None]) * y_t + h * y_h + offs_p[None, :] * y_p
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_p[None, :])


def ssd_scan_varlen_triton(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H] raw
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [T, G, N]
    C: torch.Tensor,  # [T, G, N]
    cu_seqlens: torch.Tensor,  # [S + 1]
    chunk_size: int,
    D: torch.Tensor | None = None,  # [H]
    dt_bias: torch.Tensor | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_DT_LIMIT,
    initial_states: torch.Tensor | None = None,  # [S, H, P, N] any strides / float dtype; None means zeros
    start_positions: torch.Tensor | None = None,  # [S]
    state_block: int | None = None,
    meta: ChunkMeta | None = None,  # precomputed chunk metadata (skips a host sync), from `chunk_metadata`
) -> SSDScanOutput:
    """Triton version of `ssd_scan_varlen_ref`: same arguments, same outputs (fp32 states)."""
    num_tokens, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    if chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two for the Triton scan, got {chunk_size}")
    if heads % groups != 0:
        raise ValueError(f"heads {heads} must be a multiple of groups {groups}")
    check_same_device(x, dt, A, B, C, D, dt_bias, initial_states)
    if meta is None:
        meta = chunk_metadata(cu_seqlens, start_positions, chunk_size, state_block, x.device)
    num_seqs, num_chunks, num_kept = meta.num_seqs, meta.num_chunks, meta.num_kept
    dev = x.device
    y = torch.empty_like(x)
    final = torch.empty(num_seqs, heads, head_dim, state_size, dtype=torch.float32, device=dev)
    kept = torch.empty(max(num_kept, 1), heads, head_dim, state_size, dtype=torch.float32, device=dev)
    # states entering each chunk, in x's dtype: the scan feeds them to tl.dot in that dtype anyway
    states = torch.empty(max(num_chunks, 1), heads, head_dim, state_size, dtype=x.dtype, device=dev)
    lo, hi, has_limit = finite_limits(dt_limit)
    bias = dt_bias if dt_bias is not None else A
    common = dict(HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit)
    block_n = max(16, next_pow2(state_size))  # tl.dot needs every dimension >= 16
    init = initial_states if initial_states is not None else final
    i_strides = initial_states.stride() if initial_states is not None else (0, 0, 0, 0)
    qblock = max(16, chunk_size)
    dtc = torch.empty(heads, max(num_chunks, 1), qblock, dtype=torch.float32, device=dev)
    cum = torch.empty_like(dtc)
    if num_chunks:
        _chunk_cumsum_kernel[(num_chunks, triton.cdiv(heads, 16))](
            dt, A, bias, dtc, cum, meta.chunk_start, meta.chunk_len, heads, num_chunks, lo, hi, *dt.stride(),
            QBLOCK=qblock, BLOCK_H=16, num_warps=4, **common,
        )
    if num_seqs:
        grid_state = lambda meta_: (triton.cdiv(head_dim, meta_["BLOCK_P"]), num_seqs, heads)  # noqa: E731
        _chunk_states_kernel[grid_state](
            x, dtc, cum, B, init, states, final, kept, meta.chunk_start, meta.chunk_len, meta.seq_chunk_ptr,
            meta.keep_idx, head_dim, state_size, heads, num_chunks, heads // groups,
            *x.stride(), *B.stride(), *i_strides,
            CHUNK=chunk_size, QBLOCK=qblock, BLOCK_N=block_n, HAS_INIT=initial_states is not None,
        )
    if num_chunks:
        cb = torch.empty(num_chunks, groups, chunk_size, chunk_size, dtype=torch.float32, device=dev)
        cb_block = max(16, min(64, chunk_size))  # tl.dot needs >= 16
        _chunk_cb_kernel[(triton.cdiv(chunk_size, cb_block) ** 2, num_chunks, groups)](
            B, C, cb, meta.chunk_start, meta.chunk_len, state_size, groups, *B.stride(), *C.stride(),
            CHUNK=chunk_size, BLOCK_N=block_n, BLOCK=cb_block, num_warps=4,
        )
        grid_scan = lambda meta_: (  # noqa: E731
            triton.cdiv(chunk_size, meta_["BLOCK_M"]) * triton.cdiv(head_dim, meta_["BLOCK_P"]), num_chunks, heads
        )
        _chunk_scan_kernel[grid_scan](
            x, dtc, cum, cb, C, D if D is not None else A, states, y, meta.chunk_start, meta.chunk_len,
            head_dim, state_size, heads, groups, num_chunks, heads // groups,
            *x.stride(), *C.stride(), *y.stride(),
            CHUNK=chunk_size, QBLOCK=qblock, BLOCK_N=block_n, HAS_D=D is not None,
        )
    return SSDScanOutput(
        y=y, final_states=final, chunk_states=kept[:num_kept], chunk_state_seq=meta.kept_seq, chunk_state_pos=meta.kept_pos
    )
