"""Triton SSD chunked scan over packed variable-length sequences with chunk-aligned states.

Three kernels over *logical chunks* (no chunk straddles two sequences; a resumed sequence's first chunk is
short so later chunk ends land on absolute multiples of chunk_size, exactly as the reference walks them):
  1. chunk cumsum (here): dt bias / softplus / limit and the in-chunk cumsum of dt * A, per (head, chunk).
  2. state walk (`ssd_chunk_state_triton`): the state entering every chunk, the kept chunk-end states and the
     final states, written straight into the caller's state pool rows when one is given.
  3. outputs: y = exp(cum) * C S_in^T + (causal, decayed C B^T * dt) x + D x, by one of two kernels:
     `ssd_chunk_scan_triton` (C B^T over the whole chunk, shared by several heads) or `ssd_chunk_output_triton`
     (the chunk walked in sub-blocks with the state in registers); `default_output_kernel` picks by chunk size.
Reference and contract: `hybridserve.kernels.ssd_scan.ssd_scan_varlen_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.ssd_chunk_output_triton import chunk_output_kernel
from hybridserve.kernels.ssd_chunk_scan_triton import chunk_scan_kernel
from hybridserve.kernels.ssd_chunk_state_triton import (
    WalkConfig,
    chunk_state_join_kernel,
    chunk_state_walk_kernel,
    walk_config,
)
from hybridserve.kernels.ssd_scan import NO_DT_LIMIT, DtLimit, SSDScanOutput, check_pool_args
from hybridserve.kernels.ssd_scan_meta import WHOLE_SEQUENCE, ChunkMeta, chunk_metadata
from hybridserve.kernels.triton_utils import cdiv, check_same_device, finite_limits, next_pow2, process_dt_tl


@lean_launch
@triton.jit
def _chunk_cumsum_kernel(
    dt_ptr, A_ptr, bias_ptr, dt_out_ptr, cum_ptr, wscale_ptr, chunk_start_ptr, chunk_len_ptr, H, NC, dt_lo, dt_hi,
    dt_t, dt_h,
    QBLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    """Processed dt, the in-chunk cumsum of dt * A and the state walk's token weights exp(total - cum) * dt for
    every (head, chunk): [H, NC, QBLOCK] fp32 each, with dt = 0 past the chunk's end so the cumsum stays flat
    there (its last entry is the chunk total) and the weights are 0 there."""
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
    total = tl.sum(tl.where(offs_q[:, None] == QBLOCK - 1, cum, 0.0), axis=0)  # [BLOCK_H] the cumsum's last entry
    out = (offs_h[None, :].to(tl.int64) * NC + c) * QBLOCK + offs_q[:, None]
    tl.store(dt_out_ptr + out, dt, mask=mask_h[None, :])
    tl.store(cum_ptr + out, cum, mask=mask_h[None, :])
    # computed once here instead of in every state-walk program of the head (one per state tile)
    tl.store(wscale_ptr + out, tl.exp(total[None, :] - cum) * dt, mask=mask_h[None, :])


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
    state_pool: torch.Tensor | None = None,  # [rows, H, P, N] any strides / float dtype (pool mode)
    slots: torch.Tensor | None = None,  # [S] pool row of each sequence (pool mode)
    checkpoint_rows: torch.Tensor | None = None,  # [K] pool row of each kept state, -1 = skip (pool mode)
    meta: ChunkMeta | None = None,  # precomputed chunk metadata (skips a host sync), from `chunk_metadata`
    walk: WalkConfig | None = None,  # state-walk launch shape (benchmark sweeps); None: `walk_config`
    segment_chunks: int = WHOLE_SEQUENCE,  # chunks per walk segment (walked in parallel, then joined), meta None
    output_kernel: str | None = None,  # "blocked" or "dense" (see `OUTPUT_KERNELS`); None: by chunk size
    init_rows: torch.Tensor | None = None,  # [S] pool mode: slots where start_positions > 0, else -1 (precomputed)
) -> SSDScanOutput:
    """Triton version of `ssd_scan_varlen_ref`: same arguments, same outputs (fp32 states). In pool mode the
    kernels read initial states from and write final / kept states to the pool rows directly. `init_rows` saves
    two small ops per call when every layer of a forward scans the same batch."""
    output_kernel = output_kernel or default_output_kernel(chunk_size)
    if output_kernel not in OUTPUT_KERNELS:
        raise ValueError(f"output_kernel must be one of {OUTPUT_KERNELS}, got {output_kernel!r}")
    num_tokens, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    if chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two for the Triton scan, got {chunk_size}")
    if heads % groups != 0:
        raise ValueError(f"heads {heads} must be a multiple of groups {groups}")
    check_same_device(x, dt, A, B, C, D, dt_bias, initial_states, state_pool, slots, checkpoint_rows)
    if state_pool is not None:
        check_pool_args(state_pool, slots, checkpoint_rows, initial_states, cu_seqlens.numel() - 1)
    if meta is None:
        meta = chunk_metadata(cu_seqlens, start_positions, chunk_size, state_block, x.device, segment_chunks)
    num_seqs, num_chunks, num_kept = meta.num_seqs, meta.num_chunks, meta.num_kept
    dev = x.device
    y = torch.empty_like(x)
    pooled = state_pool is not None
    if pooled:
        assert slots is not None and state_pool is not None  # check_pool_args
        if checkpoint_rows is not None and checkpoint_rows.numel() != num_kept:
            raise ValueError(f"checkpoint_rows has {checkpoint_rows.numel()} entries for {num_kept} kept states")
        final = kept = init = state_pool
        final_rows = slots
        kept_rows = checkpoint_rows if checkpoint_rows is not None else slots  # unread without HAS_KEPT
        if init_rows is None:
            resumed = start_positions > 0 if start_positions is not None else torch.zeros_like(slots, dtype=torch.bool)
            init_rows = torch.where(resumed, slots, -1)
    else:
        final = torch.empty(num_seqs, heads, head_dim, state_size, dtype=torch.float32, device=dev)
        kept = torch.empty(max(num_kept, 1), heads, head_dim, state_size, dtype=torch.float32, device=dev)
        final_rows = torch.arange(max(num_seqs, 1), device=dev)
        kept_rows = torch.arange(max(num_kept, 1), device=dev)
        init = initial_states if initial_states is not None else final
        init_rows = final_rows
    # states entering each chunk, in x's dtype: the output kernel feeds them to tl.dot in that dtype anyway
    states = torch.empty(max(num_chunks, 1), heads, head_dim, state_size, dtype=x.dtype, device=dev)
    lo, hi, has_limit = finite_limits(dt_limit)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 runs are parity runs: no TF32 rounding
    bias = dt_bias if dt_bias is not None else A
    block_n = max(16, next_pow2(state_size))  # tl.dot needs every dimension >= 16
    qblock = max(16, chunk_size)
    dtc = torch.empty(heads, max(num_chunks, 1), qblock, dtype=torch.float32, device=dev)
    cum = torch.empty_like(dtc)
    wscale = torch.empty_like(dtc)  # the walk's per-token weights: decay to the chunk end times dt
    if num_chunks:
        _chunk_cumsum_kernel[(num_chunks, cdiv(heads, 16))](
            dt, A, bias, dtc, cum, wscale, meta.chunk_start, meta.chunk_len, heads, num_chunks, lo, hi, *dt.stride(),
            QBLOCK=qblock, BLOCK_H=16, num_warps=4,
            HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
        )
    num_segments = meta.num_segments
    seg_end = torch.empty(max(num_segments, 1), heads, head_dim, state_size, dtype=torch.float32, device=dev)
    # true start states of later segments (x's dtype, added by the output kernel) and the decay to each chunk
    split = num_segments > num_seqs  # some sequence has more than one segment
    corr = torch.empty(num_segments if split else 1, heads, head_dim, state_size, dtype=x.dtype, device=dev)
    seg_decay = torch.empty(heads, max(num_chunks, 1), dtype=torch.float32, device=dev)
    has_kept = not pooled or checkpoint_rows is not None
    kept_local = torch.empty(max(num_kept, 1) if split and has_kept else 1, heads, head_dim, state_size,
                             dtype=torch.float32, device=dev)
    walk = walk or walk_config(head_dim, state_size, chunk_size, heads // groups)
    if (heads // groups) % walk.heads:
        raise ValueError(f"WalkConfig.heads ({walk.heads}) must divide the heads per group ({heads // groups})")
    tiles = cdiv(head_dim, walk.block_p) * cdiv(state_size, walk.block_n)
    has_init = pooled or initial_states is not None
    shape = dict(BLOCK_P=walk.block_p, BLOCK_N=walk.block_n, HEADS=walk.heads, QBLOCK=qblock, HAS_INIT=has_init,
                 HAS_KEPT=has_kept, num_warps=walk.num_warps)
    if num_segments:
        chunk_state_walk_kernel[(tiles, num_segments, heads // walk.heads)](
            x, wscale, cum, B, init, init_rows, states, seg_end, kept, kept_rows, kept_local,
            meta.chunk_start, meta.chunk_len, meta.seg_chunk_ptr, meta.seg_seq, meta.seg_first, meta.keep_idx,
            head_dim, state_size, heads, num_chunks, heads // groups,
            *x.stride(), *B.stride(), *_strides(init), *_strides(kept),
            CHUNK=chunk_size, DOT_PRECISION=precision, num_stages=walk.num_stages, HOIST_B=walk.hoist_b_addresses,
            **shape,
        )
    if num_seqs:
        chunk_state_join_kernel[(tiles, num_seqs, heads // walk.heads)](
            cum, init, init_rows, seg_end, corr, seg_decay, final, final_rows, kept, kept_rows, kept_local,
            meta.seg_chunk_ptr, meta.seq_seg_ptr, meta.keep_idx, head_dim, state_size, heads, num_chunks,
            *_strides(init), *_strides(final), *_strides(kept), num_stages=1, **shape,
        )
    if num_chunks:
        blocked = output_kernel == "blocked"

        def grid(meta_: dict) -> tuple[int, int, int]:
            if blocked:  # (head_dim tile, chunk, head)
                return (cdiv(head_dim, meta_["BLOCK_P"]), num_chunks, heads)
            return (cdiv(qblock, meta_["BLOCK_M"]), num_chunks, heads // meta_["HEADS"])

        (chunk_output_kernel if blocked else chunk_scan_kernel)[grid](
            x, dtc, cum, B, C, D if D is not None else A, states, corr, seg_decay, meta.chunk_seg, y,
            meta.chunk_start, meta.chunk_len,
            head_dim, state_size, heads, num_chunks, heads // groups,
            *x.stride(), *B.stride(), *C.stride(), *y.stride(),
            CHUNK=chunk_size, QBLOCK=qblock, BLOCK_N=block_n,
            HAS_D=D is not None, DOT_PRECISION=precision, HAS_SEGMENTS=split,
        )
    if state_pool is not None:  # pooled
        final, kept, num_seqs, num_kept = state_pool[:0], state_pool[:0], 0, 0
    return SSDScanOutput(
        y=y, final_states=final[:num_seqs], chunk_states=kept[:num_kept], chunk_state_seq=meta.kept_seq,
        chunk_state_pos=meta.kept_pos,
    )


OUTPUT_KERNELS = ("blocked", "dense")


def default_output_kernel(chunk_size: int) -> str:
    """The output kernel measured faster for this chunk size on the H100 (bench/results/h100/kernels/): the
    dense one (`ssd_chunk_scan_triton`) at chunk 128 (Nano-9B-v2: 441 vs 545 us per 8192 tokens), the blocked one
    (`ssd_chunk_output_triton`) at chunk 256, where the dense one's [BLOCK_M, chunk] C B^T tile spills
    (mamba2-2.7b: 171 vs 507 us)."""
    return "blocked" if chunk_size >= 256 else "dense"


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """The 4 strides of a [rows, H, P, N] state tensor (any layout)."""
    if t.dim() != 4:
        raise ValueError(f"a state tensor must be [rows, H, P, N], got shape {tuple(t.shape)}")
    return tuple(t.stride())  # type: ignore[return-value]
