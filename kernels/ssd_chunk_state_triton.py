"""Triton state walk of the varlen SSD scan: the state entering every logical chunk, the kept chunk-end states
and the final state of every sequence.

One program per (tile of the [P, N] state, sequence, head) walks the sequence's chunks in order from its
initial state, S <- exp(sum dA) S + (x * w)^T B with one tl.dot per chunk, where the token weights
w = dt exp(cum_end - cum) come precomputed from the chunk-cumsum kernel. The running state
never leaves registers, so per-chunk local states cost no memory traffic. Splitting N as well as P gives a
single long sequence enough programs to fill the GPU. Initial, final and kept states are addressed through
row indices and strides, so they can live in the caller's state pool (checkpoint slots) directly.
Launched by `ssd_scan_triton.ssd_scan_varlen_triton`; the reference is `ssd_scan.ssd_scan_varlen_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.triton_utils import interpreting, next_pow2


@dataclass(frozen=True)
class WalkConfig:
    """Launch shape of the state walk: HEADS heads (of one group) x a BLOCK_P x BLOCK_N state tile per program."""

    block_p: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    heads: int = 1  # heads stacked into the rows of one tl.dot: B is read once for all of them
    # B's tile addresses computed once before the chunk loop (fewer instructions per chunk, more registers held):
    # a win with 8 warps on 64-row tiles (mamba2-2.7b 1x8192 on H100: 124 -> 113 us), a loss with 4 warps on
    # 32-row tiles (Nano-9B-v2: 214 -> 351 us)
    hoist_b_addresses: bool = False

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
    # H100 sweeps (bench/kernels/ssd_sweep.py, bench/results/h100/): one head per program; a head_dim of up to 64 in one
    # tile with 8 warps (mamba2-2.7b 1x8192: 168 vs 198 us for 32-row tiles), else 32 x 128 tiles with 4 warps
    # (Nano-9B-v2, head_dim 80: 293 us, the best of the swept tiles)
    block_n = min(128, max(16, next_pow2(state_size)))
    if head_dim <= 64:
        return WalkConfig(max(16, next_pow2(head_dim)), block_n, 8, 2, hoist_b_addresses=True)
    return WalkConfig(32, block_n, 4, 2)


@triton.jit
def _state_tile(P, N, HEADS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of the [H, P, N] state: axis 0 picks the (P, N) block, axis 2 the HEADS heads. Row r
    is head h0 + r // BLOCK_P, head_dim index p0 + r % BLOCK_P. Returns the rows' heads and head_dim indices,
    the tile's state indices, its mask, its offsets in a contiguous [H, P, N] state and whether it is block 0."""
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_p = tl.program_id(0) // n_blocks
    pid_n = tl.program_id(0) % n_blocks
    offs_r = tl.arange(0, HEADS * BLOCK_P)
    head_r = tl.program_id(2) * HEADS + offs_r // BLOCK_P  # [ROWS]
    offs_p = pid_p * BLOCK_P + offs_r % BLOCK_P
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_pn = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    rows_out = head_r[:, None] * P * N + offs_p[:, None] * N + offs_n[None, :]  # [ROWS, BLOCK_N]
    return head_r, offs_p, offs_n, mask_pn, rows_out, pid_p + pid_n == 0


@triton.jit
def _load_init(init_ptr, init_rows_ptr, s, use, head_r, offs_p, offs_n, mask_pn, i_r, i_h, i_p, i_n):
    """Sequence s's initial state tile in fp32 where `use` and its row is >= 0 (zeros otherwise)."""
    init_row = tl.load(init_rows_ptr + s).to(tl.int64)  # -1: a fresh sequence starts from zeros
    on = (offs_p * 0 + (use & (init_row >= 0)).to(tl.int32)) > 0
    return tl.load(init_ptr + tl.maximum(init_row, 0) * i_r + head_r[:, None] * i_h + offs_p[:, None] * i_p
                   + offs_n[None, :] * i_n, mask=mask_pn & on[:, None], other=0.0).to(tl.float32)


@triton.jit
def segment_start_term(corr_ptr, seg_decay_ptr, chunk_seg_ptr, c, h, H, P, N, NC, p_idx, n_idx, mask):
    """What an output kernel adds to chunk c's walked entry state of head h when the chunk's walk segment started
    from zeros (not its sequence's first): seg_decay[h, c] * corr[segment], fp32, shaped like the broadcast
    (p_idx, n_idx) state indices; zeros for chunks of first segments."""
    seg = tl.load(chunk_seg_ptr + c)  # >= 0: the walk started this chunk's segment from zeros
    seg_decay = tl.load(seg_decay_ptr + h.to(tl.int64) * NC + c, mask=seg >= 0, other=0.0)
    corr = tl.load(corr_ptr + (tl.maximum(seg, 0).to(tl.int64) * H + h) * P * N + p_idx * N + n_idx,
                   mask=mask & (p_idx * 0 + seg >= 0), other=0.0)
    return seg_decay * corr.to(tl.float32)


@lean_launch
@triton.jit
def chunk_state_walk_kernel(
    x_ptr, wscale_ptr, cum_ptr, B_ptr, init_ptr, init_rows_ptr, states_ptr, seg_end_ptr,
    kept_ptr, kept_rows_ptr, kept_local_ptr, chunk_start_ptr, chunk_len_ptr, seg_chunk_ptr, seg_seq_ptr,
    seg_first_ptr, keep_idx_ptr,
    P, N, H, NC, heads_per_group,
    x_t, x_h, x_p, B_t, B_g, B_n,
    i_r, i_h, i_p, i_n,  # initial-state strides (row, head, P, N)
    k_r, k_h, k_p, k_n,  # kept-state strides
    CHUNK: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, HEADS: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_KEPT: tl.constexpr, DOT_PRECISION: tl.constexpr,  # "ieee" for fp32, else "tf32"
    HOIST_B: tl.constexpr,  # WalkConfig.hoist_b_addresses
):
    """Per (P x N tile, segment, HEADS heads of one group): walk the segment's chunks from the sequence's initial
    state (a first segment) or from zeros (later segments: `chunk_state_join_kernel` adds the true start state
    afterwards). Stores the state entering each chunk (x's dtype) in a contiguous [C, H, P, N] buffer, the
    segment's end state (fp32) in seg_end[segment], and kept chunk-end states: straight into kept[kept_rows[k]]
    in a first segment, into the fp32 kept_local[k] otherwise (the join completes them). Row r of the tile is
    head h0 + r // BLOCK_P, head_dim index p0 + r % BLOCK_P."""
    ROWS: tl.constexpr = HEADS * BLOCK_P
    head_r, offs_p, offs_n, mask_pn, rows_out, _ = _state_tile(P, N, HEADS, BLOCK_P, BLOCK_N)
    seg = tl.program_id(1)
    h0 = tl.program_id(2) * HEADS
    g = h0 // heads_per_group  # HEADS divides heads_per_group: all rows read the same B
    s = tl.load(seg_seq_ptr + seg)
    first_flag = tl.load(seg_first_ptr + seg)  # 1 in a sequence's first segment
    is_first = first_flag != 0
    state = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if HAS_INIT:
        state = _load_init(init_ptr, init_rows_ptr, s, is_first, head_r, offs_p, offs_n, mask_pn, i_r, i_h, i_p, i_n)
    offs_q = tl.arange(0, QBLOCK)  # CHUNK padded to the 16 tl.dot needs
    offs_h = h0 + tl.arange(0, HEADS)
    c0 = tl.load(seg_chunk_ptr + seg)
    c1 = tl.load(seg_chunk_ptr + seg + 1)
    # a segment's chunks are contiguous: the first may be short, the rest are CHUNK long (the last may be short);
    # computing starts from the loop index keeps the loads independent of earlier loads (pipelinable)
    begin = tl.load(chunk_start_ptr + c0).to(tl.int64)
    first = tl.load(chunk_len_ptr + c0)
    seg_len = tl.load(chunk_start_ptr + c1 - 1).to(tl.int64) - begin + tl.load(chunk_len_ptr + c1 - 1)
    # the tiles' addresses relative to the chunk start, computed once: in the loop only a scalar offset moves
    x_tile = x_ptr + offs_q[None, :].to(tl.int64) * x_t + head_r[:, None] * x_h + offs_p[:, None] * x_p
    if HOIST_B:
        B_tile = B_ptr + offs_q[:, None].to(tl.int64) * B_t + g * B_g + offs_n[None, :] * B_n
    mask_xp, mask_bn = (offs_p < P)[:, None], (offs_n < N)[None, :]
    # chunks past the segment's last token (the empty chunks that pad a CUDA-graph prefill to its captured chunk
    # count, engine/prefill_graphs.py) are not walked: nothing reads their entry state, and walking them would
    # lengthen this program's serial chain
    num_walked = tl.where(seg_len > 0, 1 + (tl.maximum(seg_len - first, 0) + CHUNK - 1) // CHUNK, 0)
    for i in range(0, num_walked):
        offset = tl.where(i == 0, 0, first + (i - 1) * CHUNK).to(tl.int64)
        length = tl.minimum(tl.where(i == 0, first, CHUNK), seg_len - offset).to(tl.int32)  # 32-bit mask compares
        start = begin + offset
        c = tl.cast(c0 + i, tl.int64)
        tl.store(states_ptr + c * H * P * N + rows_out, state.to(states_ptr.dtype.element_ty), mask=mask_pn)
        mask_q = offs_q < length
        row = (offs_h[:, None].to(tl.int64) * NC + c) * QBLOCK  # [HEADS, 1] this chunk's dt / cumsum rows
        scale = tl.load(wscale_ptr + row + offs_q[None, :])  # [HEADS, QBLOCK] decay to the chunk end, times dt
        total = tl.load(cum_ptr + row + QBLOCK - 1)  # [HEADS, 1]
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (HEADS, BLOCK_P, QBLOCK)), (ROWS, QBLOCK))
        decay = tl.reshape(tl.broadcast_to(tl.exp(total), (HEADS, BLOCK_P)), (ROWS,))
        xT = tl.load(x_tile + start * x_t, mask=mask_xp & mask_q[None, :], other=0.0)  # [ROWS, QBLOCK]
        if HOIST_B:
            Bq = tl.load(B_tile + start * B_t, mask=mask_q[:, None] & mask_bn, other=0.0)  # [QBLOCK, BLOCK_N]
        else:
            Bq = tl.load(B_ptr + (start + offs_q[:, None]) * B_t + g * B_g + offs_n[None, :] * B_n,
                         mask=mask_q[:, None] & mask_bn, other=0.0)
        xs = (xT.to(tl.float32) * scale).to(Bq.dtype)
        state = decay[:, None] * state + tl.dot(xs, Bq, input_precision=DOT_PRECISION)
        if HAS_KEPT:  # without it keep_idx may index past kept_rows (a pool-mode call that keeps nothing)
            k = tl.load(keep_idx_ptr + c)
            # scalar branches: chunks that keep nothing (most) skip the address math of a whole tile
            if k >= 0:
                kept_row = tl.load(kept_rows_ptr + k).to(tl.int64)
                if kept_row >= 0:
                    if is_first:
                        tl.store(kept_ptr + kept_row * k_r + head_r[:, None] * k_h + offs_p[:, None] * k_p
                                 + offs_n[None, :] * k_n, state.to(kept_ptr.dtype.element_ty), mask=mask_pn)
                    else:
                        tl.store(kept_local_ptr + k.to(tl.int64) * H * P * N + rows_out, state, mask=mask_pn)
    # an empty segment (a padding sequence of a CUDA-graph prefill, whose final row is -1) leaves its end unread
    walked = (tl.zeros([ROWS, BLOCK_N], dtype=tl.int32) + num_walked) > 0  # a tensor mask (the interpreter's need)
    tl.store(seg_end_ptr + tl.cast(seg, tl.int64) * H * P * N + rows_out, state, mask=mask_pn & walked)


@lean_launch
@triton.jit
def chunk_state_join_kernel(
    cum_ptr, init_ptr, init_rows_ptr, seg_end_ptr, corr_ptr, seg_decay_ptr, final_ptr, final_rows_ptr,
    kept_ptr, kept_rows_ptr, kept_local_ptr, seg_chunk_ptr, seq_seg_ptr, keep_idx_ptr,
    P, N, H, NC,
    i_r, i_h, i_p, i_n, f_r, f_h, f_p, f_n, k_r, k_h, k_p, k_n,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, HEADS: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_KEPT: tl.constexpr,
):
    """Per (P x N tile, sequence, HEADS heads): walk the sequence's segments in order carrying the true state.
    For every segment after the first: store its true start state in corr[segment] (x's dtype) and, per chunk,
    the decay from the segment start to the chunk start in seg_decay[h, c] (the output kernel adds
    seg_decay * corr to the chunk's walked state), and complete its kept states. Stores every final state."""
    ROWS: tl.constexpr = HEADS * BLOCK_P
    head_r, offs_p, offs_n, mask_pn, rows_out, block0 = _state_tile(P, N, HEADS, BLOCK_P, BLOCK_N)
    s = tl.program_id(1)
    lead = (offs_p % BLOCK_P == 0) & ((offs_p * 0 + block0.to(tl.int32)) > 0)  # one seg_decay writer per head
    k0 = tl.load(seq_seg_ptr + s)
    k1 = tl.load(seq_seg_ptr + s + 1)
    state = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)  # true start of the current segment (0 for the first:
    # its walk already started from the initial state); an empty sequence keeps its initial state
    if HAS_INIT:
        state = _load_init(init_ptr, init_rows_ptr, s, k1 == k0, head_r, offs_p, offs_n, mask_pn, i_r, i_h, i_p, i_n)
    final_row = tl.load(final_rows_ptr + s).to(tl.int64)
    # a one-segment sequence whose final state is not kept (padding of a CUDA-graph prefill: its segment's end was
    # not even stored) reads nothing: 4 bytes x H x P x N saved per padding sequence and layer
    zeros = tl.zeros([ROWS, BLOCK_N], dtype=tl.int32)  # tensor masks: the interpreter rejects scalar booleans
    needed = ((zeros + final_row) >= 0) | ((zeros + (k1 - k0)) > 1)
    for seg in range(k0, k1):
        seg64 = tl.cast(seg, tl.int64)
        decay = tl.full([ROWS], 1.0, dtype=tl.float32)  # from the segment start to the current chunk start
        if seg > k0:
            tl.store(corr_ptr + seg64 * H * P * N + rows_out, state.to(corr_ptr.dtype.element_ty), mask=mask_pn)
            for c in range(tl.load(seg_chunk_ptr + seg), tl.load(seg_chunk_ptr + seg + 1)):
                tl.store(seg_decay_ptr + head_r.to(tl.int64) * NC + c, decay, mask=lead)
                decay = decay * tl.exp(tl.load(cum_ptr + (head_r.to(tl.int64) * NC + c) * QBLOCK + QBLOCK - 1))
                if HAS_KEPT:
                    k = tl.load(keep_idx_ptr + c)
                    kept_row = tl.load(kept_rows_ptr + tl.maximum(k, 0), mask=k >= 0, other=-1).to(tl.int64)
                    if kept_row >= 0:
                        local = tl.load(kept_local_ptr + k.to(tl.int64) * H * P * N + rows_out, mask=mask_pn,
                                        other=0.0)
                        tl.store(kept_ptr + kept_row * k_r + head_r[:, None] * k_h + offs_p[:, None] * k_p
                                 + offs_n[None, :] * k_n, (local + decay[:, None] * state).to(
                                     kept_ptr.dtype.element_ty), mask=mask_pn)
        end = tl.load(seg_end_ptr + seg64 * H * P * N + rows_out, mask=mask_pn & needed, other=0.0)
        state = end + decay[:, None] * state
    tl.store(final_ptr + tl.maximum(final_row, 0) * f_r + head_r[:, None] * f_h + offs_p[:, None] * f_p
             + offs_n[None, :] * f_n, state.to(final_ptr.dtype.element_ty),
             mask=mask_pn & (offs_p * 0 + final_row >= 0)[:, None])
