"""Triton state walk of the varlen SSD scan: the state entering every logical chunk, the kept chunk-end states
and the final state of every sequence.

One program per (tile of the [P, N] state, sequence, head) walks the sequence's chunks in order from its
initial state, S <- exp(sum dA) S + x^T (B dt exp(cum_end - cum)) with one tl.dot per chunk. The running state
never leaves registers, so per-chunk local states cost no memory traffic. Splitting N as well as P gives a
single long sequence enough programs to fill the GPU. Initial, final and kept states are addressed through
row indices and strides, so they can live in the caller's state pool (checkpoint slots) directly.
Launched by `ssd_scan_triton.ssd_scan_varlen_triton`; the reference is `ssd_scan.ssd_scan_varlen_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from hybridserve.kernels.triton_utils import interpreting


@dataclass(frozen=True)
class WalkConfig:
    """Launch shape of the state walk: HEADS heads (of one group) x a BLOCK_P x BLOCK_N state tile per program."""

    block_p: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    heads: int = 1  # heads stacked into the rows of one tl.dot: B is read once for all of them

    def __post_init__(self) -> None:
        for name in ("block_p", "block_n", "heads"):
            value = getattr(self, name)
            if value <= 0 or value & (value - 1):
                raise ValueError(f"WalkConfig.{name} must be a positive power of two, got {value}")
        if self.block_p < 16 and self.block_p * self.heads < 16:
            raise ValueError("WalkConfig needs block_p * heads >= 16 (the rows of a tl.dot)")


def walk_config(head_dim: int, state_size: int, chunk_size: int, heads_per_group: int = 1) -> WalkConfig:
    """Fixed (not autotuned: in pool mode a rerun would read its own output) tile choice per problem size."""
    if interpreting():
        return WalkConfig(16, 16, 4, 1, heads=2 if heads_per_group % 2 == 0 else 1)
    # H100 sweep (bench/kernels.py --sweep-walk): 16 x 64 tiles; 2 warps for chunk 128 (Nano-9B-v2: 0.81 vs
    # 0.94 ms with 4 warps at 1x8192), 4 warps for chunk 256 (mamba2-2.7b: 0.61 vs 0.72 ms)
    warps = 2 if chunk_size <= 128 else 4
    return WalkConfig(16, min(64, max(16, state_size)), warps, 2)


@triton.jit
def chunk_state_walk_kernel(
    x_ptr, dtc_ptr, cum_ptr, B_ptr, init_ptr, init_rows_ptr, states_ptr, final_ptr, final_rows_ptr,
    kept_ptr, kept_rows_ptr, chunk_start_ptr, chunk_len_ptr, seq_chunk_ptr, keep_idx_ptr,
    P, N, H, NC, heads_per_group,
    x_t, x_h, x_p, B_t, B_g, B_n,
    i_r, i_h, i_p, i_n,  # initial-state strides (row, head, P, N)
    f_r, f_h, f_p, f_n,  # final-state strides
    k_r, k_h, k_p, k_n,  # kept-state strides
    CHUNK: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, HEADS: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_KEPT: tl.constexpr, DOT_PRECISION: tl.constexpr,  # "ieee" for fp32, else "tf32"
):
    """Per (P x N tile, sequence, HEADS heads of one group): store the state entering each chunk (x's dtype,
    for the output kernel) in a contiguous [C, H, P, N] buffer, the kept chunk-end states into
    kept[kept_rows[k]] and the final state into final[final_rows[s]] (each cast to its buffer's dtype; a row
    of -1 is skipped). Row r of the tile is head h0 + r // BLOCK_P, head_dim index p0 + r % BLOCK_P."""
    ROWS: tl.constexpr = HEADS * BLOCK_P
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_p = tl.program_id(0) // n_blocks
    pid_n = tl.program_id(0) % n_blocks
    s = tl.program_id(1)
    h0 = tl.program_id(2) * HEADS
    g = h0 // heads_per_group  # HEADS divides heads_per_group: all rows read the same B
    offs_r = tl.arange(0, ROWS)
    head_r = h0 + offs_r // BLOCK_P  # [ROWS]
    offs_p = pid_p * BLOCK_P + offs_r % BLOCK_P
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_pn = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    rows_out = head_r[:, None] * P * N + offs_p[:, None] * N + offs_n[None, :]  # [ROWS, BLOCK_N] in [H, P, N]
    state = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if HAS_INIT:
        init_row = tl.load(init_rows_ptr + s).to(tl.int64)  # -1: a fresh sequence starts from zeros
        state = tl.load(init_ptr + tl.maximum(init_row, 0) * i_r + head_r[:, None] * i_h + offs_p[:, None] * i_p
                        + offs_n[None, :] * i_n, mask=mask_pn & (offs_p * 0 + init_row >= 0)[:, None],
                        other=0.0).to(tl.float32)
    offs_q = tl.arange(0, QBLOCK)  # CHUNK padded to the 16 tl.dot needs
    offs_h = h0 + tl.arange(0, HEADS)
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
        tl.store(states_ptr + c * H * P * N + rows_out, state.to(states_ptr.dtype.element_ty), mask=mask_pn)
        mask_q = offs_q < length
        row = (offs_h[:, None].to(tl.int64) * NC + c) * QBLOCK  # [HEADS, 1] this chunk's dt / cumsum rows
        dt_q = tl.load(dtc_ptr + row + offs_q[None, :])  # [HEADS, QBLOCK]
        cum_q = tl.load(cum_ptr + row + offs_q[None, :])
        total = tl.load(cum_ptr + row + QBLOCK - 1)  # [HEADS, 1]
        scale = tl.exp(total - cum_q) * dt_q  # [HEADS, QBLOCK] decay to the chunk end, times dt
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (HEADS, BLOCK_P, QBLOCK)), (ROWS, QBLOCK))
        decay = tl.reshape(tl.broadcast_to(tl.exp(total), (HEADS, BLOCK_P)), (ROWS,))
        xT = tl.load(x_ptr + (start + offs_q[None, :]) * x_t + head_r[:, None] * x_h + offs_p[:, None] * x_p,
                     mask=(offs_p < P)[:, None] & mask_q[None, :], other=0.0)  # [ROWS, QBLOCK]
        Bq = tl.load(B_ptr + (start + offs_q[:, None]) * B_t + g * B_g + offs_n[None, :] * B_n,
                     mask=mask_q[:, None] & (offs_n < N)[None, :], other=0.0)  # [QBLOCK, BLOCK_N]
        xs = (xT.to(tl.float32) * scale).to(Bq.dtype)
        state = decay[:, None] * state + tl.dot(xs, Bq, input_precision=DOT_PRECISION)
        if HAS_KEPT:  # without it keep_idx may index past kept_rows (a pool-mode call that keeps nothing)
            k = tl.load(keep_idx_ptr + c)
            kept_row = tl.load(kept_rows_ptr + tl.maximum(k, 0), mask=k >= 0, other=-1).to(tl.int64)
            tl.store(kept_ptr + tl.maximum(kept_row, 0) * k_r + head_r[:, None] * k_h + offs_p[:, None] * k_p
                     + offs_n[None, :] * k_n, state.to(kept_ptr.dtype.element_ty),
                     mask=mask_pn & (offs_p * 0 + kept_row >= 0)[:, None])
    final_row = tl.load(final_rows_ptr + s).to(tl.int64)
    tl.store(final_ptr + tl.maximum(final_row, 0) * f_r + head_r[:, None] * f_h + offs_p[:, None] * f_p
             + offs_n[None, :] * f_n, state.to(final_ptr.dtype.element_ty),
             mask=mask_pn & (offs_p * 0 + final_row >= 0)[:, None])
