"""Triton depthwise causal conv1d: varlen prefill (with initial windows, final and block-boundary windows)
and the decode / verify update on a strided window pool (in place, padded slots skipped).

A token's K inputs come from the packed x when they belong to its sequence and from the sequence's initial
window otherwise, so prefill needs no concatenation. In pool mode (`conv_pool`, `slots`, `boundary_rows`) the
initial windows are read from, and the final / boundary windows written to, the pool rows through its strides.
Reference and contract: `hybridserve.kernels.causal_conv1d`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.causal_conv1d import (
    ConvVarlenMeta,
    ConvVarlenOutput,
    check_boundary_rows,
    check_conv_pool_args,
    conv_varlen_metadata,
)
from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.triton_utils import cdiv, check_same_device, next_pow2, pdl_gate, pdl_launch


@triton.jit
def _window_row(seq, rows_ptr, start_ptr, HAS_ROWS: tl.constexpr, GATED: tl.constexpr):
    """(row of the sequence's initial window, whether to read it): row = rows[seq] or seq; read unless GATED
    and the sequence starts at position 0 (fresh: zeros)."""
    row = seq
    if HAS_ROWS:
        row = tl.load(rows_ptr + seq).to(tl.int64)
    resumed = 1  # an int flag: the interpreter rejects masks built from scalar booleans
    if GATED:
        resumed = (tl.load(start_ptr + seq) > 0).to(tl.int32)
    return row, resumed


@triton.jit
def _history(x_ptr, win_ptr, begin, row, resumed, rel, offs_d, mask, x_t, x_d, w_s, w_d, w_w, W,
             HAS_INIT: tl.constexpr):
    """Input at relative position `rel` of a sequence (rel < 0: column W + rel of window row `row`, or 0)."""
    from_x = rel >= 0
    val = tl.load(x_ptr + (begin + tl.maximum(rel, 0)) * x_t + offs_d * x_d, mask=mask & from_x, other=0.0)
    val = val.to(tl.float32)
    if HAS_INIT:
        col = W + tl.minimum(rel, 0)
        use = mask & (rel < 0) & (rel * 0 + resumed > 0)
        old = tl.load(win_ptr + row * w_s + offs_d * w_d + col * w_w, mask=use, other=0.0)
        val = tl.where(from_x, val, old.to(tl.float32))
    return val


@lean_launch
@triton.jit
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, win_ptr, rows_ptr, start_ptr, y_ptr, cu_ptr, token_seq_ptr,
    T, D, W, x_t, x_d, w_s, w_d, w_w, wt_d, wt_k, y_t, y_d,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_ROWS: tl.constexpr, GATED: tl.constexpr,
    SILU: tl.constexpr,
):
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    for i in range(BLOCK_T):
        t = tl.program_id(0) * BLOCK_T + i
        if t < T:
            seq = tl.load(token_seq_ptr + t).to(tl.int64)
            begin = tl.load(cu_ptr + seq).to(tl.int64)
            row, resumed = _window_row(seq, rows_ptr, start_ptr, HAS_ROWS, GATED)
            acc = bias
            for k in tl.static_range(K):
                rel = offs_d * 0 + (t - begin - (K - 1) + k)  # [BLOCK_D], same value
                v = _history(x_ptr, win_ptr, begin, row, resumed, rel, offs_d, mask_d, x_t, x_d, w_s, w_d, w_w, W,
                             HAS_INIT)
                acc += v * tl.load(w_ptr + offs_d * wt_d + k * wt_k, mask=mask_d, other=0.0).to(tl.float32)
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(y_ptr + t * y_t + offs_d * y_d, acc.to(y_ptr.dtype.element_ty), mask=mask_d)


@lean_launch
@triton.jit
def _window_gather_kernel(
    x_ptr, win_ptr, rows_ptr, start_ptr, out_ptr, out_row_ptr, cu_ptr, out_seq_ptr, out_len_ptr,
    D, W, x_t, x_d, w_s, w_d, w_w, o_s, o_d, o_w,
    BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_ROWS: tl.constexpr,
    GATED: tl.constexpr, HAS_OUT_ROWS: tl.constexpr, IN_PLACE: tl.constexpr,
):
    """Row out_row[i] (or i; -1 skips) of out = the W inputs before relative position out_len[i] of sequence
    out_seq[i]: [D, W], cast to out's dtype. IN_PLACE: out may be the row the window is read from."""
    i = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_w = tl.arange(0, BLOCK_W)
    seq = tl.load(out_seq_ptr + i).to(tl.int64)
    length = tl.load(out_len_ptr + i).to(tl.int64)
    begin = tl.load(cu_ptr + seq).to(tl.int64)
    out_row = i.to(tl.int64)
    if HAS_OUT_ROWS:
        out_row = tl.load(out_row_ptr + i).to(tl.int64)
    row, resumed = _window_row(seq, rows_ptr, start_ptr, HAS_ROWS, GATED)
    rel = length - W + offs_w  # [BLOCK_W]
    mask = (offs_d[:, None] < D) & (offs_w[None, :] < W) & (offs_w[None, :] * 0 + out_row >= 0)
    vals = _history(x_ptr, win_ptr, begin, row, resumed, rel[None, :], offs_d[:, None], mask, x_t, x_d, w_s, w_d,
                    w_w, W, HAS_INIT)
    if IN_PLACE:
        # the tile's columns shift by `length`: every thread must have read the old window before any overwrites it
        tl.debug_barrier()
    dst = out_ptr + tl.maximum(out_row, 0) * o_s + offs_d[:, None] * o_d + offs_w[None, :] * o_w
    tl.store(dst, vals.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_gather(
    x: torch.Tensor, src: torch.Tensor | None, src_rows: torch.Tensor | None, gate: torch.Tensor | None,
    out: torch.Tensor, out_rows: torch.Tensor | None, cu_seqlens: torch.Tensor, out_seq: torch.Tensor,
    out_len: torch.Tensor, width: int, in_place: bool,
) -> None:
    """Write len(out_seq) windows into out ([N, D, W], rows out_rows or 0..N-1); src holds initial windows."""
    num, channels = out_seq.numel(), x.shape[1]
    if num == 0:
        return
    block_d = min(256, next_pow2(channels))
    dummy = cu_seqlens
    _window_gather_kernel[(num, cdiv(channels, block_d))](
        x, src if src is not None else out, src_rows if src_rows is not None else dummy,
        gate if gate is not None else dummy, out, out_rows if out_rows is not None else dummy, cu_seqlens,
        out_seq, out_len, channels, width, *x.stride(), *(src.stride() if src is not None else (0, 0, 0)),
        *out.stride(), BLOCK_D=block_d, BLOCK_W=next_pow2(width), HAS_INIT=src is not None,
        HAS_ROWS=src_rows is not None, GATED=gate is not None, HAS_OUT_ROWS=out_rows is not None,
        IN_PLACE=in_place, num_warps=4,
    )


def causal_conv1d_varlen_triton(
    x: torch.Tensor,  # [T, D] packed tokens (row stride free)
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    cu_seqlens: torch.Tensor,  # [S + 1]
    initial_windows: torch.Tensor | None = None,  # [S, D, W]; None means zeros
    activation: str | None = "silu",
    window_width: int | None = None,
    start_positions: torch.Tensor | None = None,  # [S]
    state_block: int | None = None,
    *,
    conv_pool: torch.Tensor | None = None,  # [rows, D, W] any float dtype / strides: windows read and written here
    slots: torch.Tensor | None = None,  # [S] int64 pool row of each sequence (initial window if resumed, final)
    boundary_rows: torch.Tensor | None = None,  # [K] int64 pool row of each boundary window, -1 = don't write
    meta: ConvVarlenMeta | None = None,  # precomputed indices (no host sync); None: built here from the tensors
) -> ConvVarlenOutput:
    """Triton version of `causal_conv1d_varlen_ref`; same outputs (windows in fp32). With conv_pool the kernels
    read and write the pool rows themselves (no gather / scatter copies)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}; expected 'silu' or None")
    pooled = conv_pool is not None or slots is not None or boundary_rows is not None
    if pooled:
        check_conv_pool_args(x, cu_seqlens, initial_windows, window_width, conv_pool, slots, boundary_rows)
        assert conv_pool is not None and slots is not None  # checked above
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    num_seqs = cu_seqlens.numel() - 1
    if conv_pool is not None:
        width = conv_pool.shape[2]
    else:
        width = initial_windows.shape[-1] if initial_windows is not None else (window_width or kernel - 1)
    if width < kernel - 1:
        raise ValueError(f"conv window width {width} is smaller than conv_kernel-1 = {kernel - 1}")
    if state_block is not None and state_block <= 0:
        raise ValueError(f"state_block must be positive, got {state_block}")
    check_same_device(x, weight, bias, cu_seqlens, initial_windows, conv_pool, slots, boundary_rows,
                      start_positions if pooled else None)
    dev = x.device
    # where the initial windows come from: the pool rows of resumed sequences, the given windows, or zeros
    if conv_pool is not None:
        src = conv_pool if start_positions is not None else None  # no start positions: every sequence is fresh
        src_rows, gate = slots, start_positions
    else:
        src, src_rows, gate = initial_windows, None, None
    if meta is None:  # which windows to gather: the final one of each sequence, then every boundary crossed
        lens = [int(n) for n in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()]
        starts = None if start_positions is None else [int(p) for p in start_positions.tolist()]
        meta = conv_varlen_metadata(lens, starts, state_block, dev)
    if len(meta.seq_lens) != num_seqs or sum(meta.seq_lens) != num_tokens:
        raise ValueError(f"conv metadata describes {len(meta.seq_lens)} sequences / {sum(meta.seq_lens)} tokens, "
                         f"the batch has {num_seqs} / {num_tokens}")
    num_boundaries = len(meta.boundary_seq)
    if pooled:
        check_boundary_rows(boundary_rows, num_boundaries)
    y = torch.empty(num_tokens, channels, dtype=x.dtype, device=dev)
    block_d = min(256, next_pow2(channels))
    if num_tokens:
        block_t = 8
        _conv_varlen_kernel[(cdiv(num_tokens, block_t), cdiv(channels, block_d))](
            x, weight, bias if bias is not None else weight, src if src is not None else y,
            src_rows if src_rows is not None else cu_seqlens, gate if gate is not None else cu_seqlens, y,
            cu_seqlens, meta.token_seq, num_tokens, channels, width, *x.stride(),
            *(src.stride() if src is not None else (0, 0, 0)), *weight.stride(), *y.stride(),
            K=kernel, BLOCK_T=block_t, BLOCK_D=block_d, HAS_BIAS=bias is not None, HAS_INIT=src is not None,
            HAS_ROWS=src_rows is not None, GATED=gate is not None, SILU=activation is not None, num_warps=4,
        )
    if conv_pool is not None:
        # boundaries first: they may read a sequence's initial window from the slot row its final window overwrites
        if boundary_rows is not None and num_boundaries:
            _launch_gather(x, src, src_rows, gate, conv_pool, boundary_rows, cu_seqlens, meta.boundary_seq_i32,
                           meta.boundary_len_i32, width, in_place=False)
        _launch_gather(x, src, src_rows, gate, conv_pool, slots, cu_seqlens, meta.final_seq, meta.final_len, width,
                       in_place=True)
        empty = torch.empty(0, channels, width, dtype=torch.float32, device=dev)
        return ConvVarlenOutput(y=y, final_windows=empty, boundary_windows=empty, boundary_seq=meta.boundary_seq_t,
                                boundary_pos=meta.boundary_pos_t)
    windows = torch.empty(num_seqs + num_boundaries, channels, width, dtype=torch.float32, device=dev)
    _launch_gather(x, src, None, None, windows, None, cu_seqlens, meta.gather_seq, meta.gather_len, width,
                   in_place=False)
    return ConvVarlenOutput(
        y=y,
        final_windows=windows[:num_seqs],
        boundary_windows=windows[num_seqs:],
        boundary_seq=meta.boundary_seq_t,
        boundary_pos=meta.boundary_pos_t,
    )


@lean_launch
@triton.jit
def _conv_update_kernel(
    x_ptr, pool_ptr, slots_ptr, w_ptr, bias_ptr, y_ptr,
    T, D, W, x_b, x_t, x_d, p_s, p_d, p_w, wt_d, wt_k, y_b, y_t, y_d,
    K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_gate(USE_PDL)
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    valid = (offs_d * 0 + slot) >= 0  # padded rows: zero output, window untouched
    slot = tl.maximum(slot, 0)
    mask_d = offs_d < D
    mask_v = mask_d & valid
    win = pool_ptr + slot * p_s + offs_d * p_d
    xb = x_ptr + b * x_b + offs_d * x_d
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    # the new window (last W of old window ++ x) is read before anything is written
    offs_w = tl.arange(0, BLOCK_W)
    src = T + offs_w[None, :]  # column in old window ++ x
    m2 = mask_v[:, None] & (offs_w[None, :] < W)
    new_old = tl.load(win[:, None] + src * p_w, mask=m2 & (src < W), other=0.0)
    new_x = tl.load(xb[:, None] + (src - W) * x_t, mask=m2 & (src >= W), other=0.0)
    new_win = tl.where(src < W, new_old.to(tl.float32), new_x.to(tl.float32))
    for t in range(T):
        acc = bias
        for k in tl.static_range(K):
            col = offs_d * 0 + (W - (K - 1) + t + k)  # [BLOCK_D] column in old window ++ x
            v_old = tl.load(win + col * p_w, mask=mask_v & (col < W), other=0.0).to(tl.float32)
            v_x = tl.load(xb + (col - W) * x_t, mask=mask_v & (col >= W), other=0.0).to(tl.float32)
            acc += tl.where(col < W, v_old, v_x) * tl.load(w_ptr + offs_d * wt_d + k * wt_k, mask=mask_d,
                                                            other=0.0).to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        acc = tl.where(valid, acc, 0.0)
        tl.store(y_ptr + b * y_b + t * y_t + offs_d * y_d, acc.to(y_ptr.dtype.element_ty), mask=mask_d)
    # the window tile's layout spreads channels over threads differently from the loop's vectors: wait until
    # every thread has read the old window before any thread overwrites it
    tl.debug_barrier()
    tl.store(win[:, None] + offs_w[None, :] * p_w, new_win.to(pool_ptr.dtype.element_ty), mask=m2)


def causal_conv1d_update_triton(
    x: torch.Tensor,  # [B, T, D]
    conv_state_pool: torch.Tensor,  # [num_slots, D, W] (any strides), updated in place at `slots`
    slots: torch.Tensor,  # [B], -1 = padded row
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,  # [B, T, D]
) -> torch.Tensor:
    """Triton version of `causal_conv1d_update_ref`; returns y [B, T, D] in x's dtype."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}; expected 'silu' or None")
    batch, tokens, channels = x.shape
    kernel, width = weight.shape[1], conv_state_pool.shape[-1]
    if width < kernel - 1:
        raise ValueError(f"conv state width {width} is smaller than conv_kernel-1 = {kernel - 1}")
    check_same_device(x, conv_state_pool, slots, weight, bias)
    y = torch.empty(batch, tokens, channels, dtype=x.dtype, device=x.device) if out is None else out
    if batch == 0:
        return y
    block_d = min(256, next_pow2(channels))
    _conv_update_kernel[(batch, cdiv(channels, block_d))](
        x, conv_state_pool, slots, weight, bias if bias is not None else weight, y,
        tokens, channels, width, *x.stride(), *conv_state_pool.stride(), *weight.stride(), *y.stride(),
        K=kernel, BLOCK_D=block_d, BLOCK_W=next_pow2(width), HAS_BIAS=bias is not None,
        SILU=activation is not None, num_warps=4, **pdl_launch(x.device),
    )
    return y
