"""Triton depthwise causal conv1d: varlen prefill (with initial windows, final and block-boundary windows)
and the decode / verify update on a strided window pool (in place, padded slots skipped).

A token's K inputs come from the packed x when they belong to its sequence and from the sequence's initial
window otherwise, so prefill needs no concatenation. Reference and contract: `hybridserve.kernels.causal_conv1d`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.causal_conv1d import ConvVarlenOutput
from hybridserve.kernels.triton_utils import check_same_device, next_pow2


@triton.jit
def _history(x_ptr, win_ptr, begin, seq, rel, offs_d, mask, x_t, x_d, w_s, w_d, w_w, W, HAS_INIT: tl.constexpr):
    """Input at relative position `rel` of a sequence (rel < 0: column W + rel of its initial window)."""
    from_x = rel >= 0
    val = tl.load(x_ptr + (begin + tl.maximum(rel, 0)) * x_t + offs_d * x_d, mask=mask & from_x, other=0.0)
    if HAS_INIT:
        col = W + tl.minimum(rel, 0)
        old = tl.load(win_ptr + seq * w_s + offs_d * w_d + col * w_w, mask=mask & (rel < 0), other=0.0)
        val = tl.where(from_x, val, old)
    return val.to(tl.float32)


@triton.jit
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, win_ptr, y_ptr, cu_ptr, token_seq_ptr,
    T, D, W, x_t, x_d, w_s, w_d, w_w, wt_d, wt_k, y_t, y_d,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
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
            acc = bias
            for k in tl.static_range(K):
                rel = offs_d * 0 + (t - begin - (K - 1) + k)  # [BLOCK_D], same value
                v = _history(x_ptr, win_ptr, begin, seq, rel, offs_d, mask_d, x_t, x_d, w_s, w_d, w_w, W, HAS_INIT)
                acc += v * tl.load(w_ptr + offs_d * wt_d + k * wt_k, mask=mask_d, other=0.0).to(tl.float32)
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(y_ptr + t * y_t + offs_d * y_d, acc.to(y_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _window_gather_kernel(
    x_ptr, win_ptr, out_ptr, cu_ptr, out_seq_ptr, out_len_ptr,
    D, W, x_t, x_d, w_s, w_d, w_w,
    BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """out[i] = the W inputs before relative position out_len[i] of sequence out_seq[i]: [D, W] fp32."""
    i = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_w = tl.arange(0, BLOCK_W)
    seq = tl.load(out_seq_ptr + i).to(tl.int64)
    length = tl.load(out_len_ptr + i).to(tl.int64)
    begin = tl.load(cu_ptr + seq).to(tl.int64)
    rel = length - W + offs_w  # [BLOCK_W]
    mask = (offs_d[:, None] < D) & (offs_w[None, :] < W)
    vals = _history(x_ptr, win_ptr, begin, seq, rel[None, :], offs_d[:, None], mask, x_t, x_d, w_s, w_d, w_w, W,
                    HAS_INIT)
    tl.store(out_ptr + i * D * W + offs_d[:, None] * W + offs_w[None, :], vals, mask=mask)


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
) -> ConvVarlenOutput:
    """Triton version of `causal_conv1d_varlen_ref`; same outputs (windows in fp32)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}; expected 'silu' or None")
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    num_seqs = cu_seqlens.numel() - 1
    width = initial_windows.shape[-1] if initial_windows is not None else (window_width or kernel - 1)
    if width < kernel - 1:
        raise ValueError(f"conv window width {width} is smaller than conv_kernel-1 = {kernel - 1}")
    if state_block is not None and state_block <= 0:
        raise ValueError(f"state_block must be positive, got {state_block}")
    check_same_device(x, weight, bias, cu_seqlens, initial_windows)
    dev = x.device
    y = torch.empty(num_tokens, channels, dtype=x.dtype, device=dev)
    win = initial_windows if initial_windows is not None else y
    w_strides = initial_windows.stride() if initial_windows is not None else (0, 0, 0)
    block_d = min(256, next_pow2(channels))
    if num_tokens:
        token_seq = torch.searchsorted(cu_seqlens[1:], torch.arange(num_tokens, device=dev), right=True)
        block_t = 8
        _conv_varlen_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_d))](
            x, weight, bias if bias is not None else weight, win, y, cu_seqlens, token_seq,
            num_tokens, channels, width, *x.stride(), *w_strides, *weight.stride(), *y.stride(),
            K=kernel, BLOCK_T=block_t, BLOCK_D=block_d, HAS_BIAS=bias is not None,
            HAS_INIT=initial_windows is not None, SILU=activation is not None, num_warps=4,
        )
    # which windows to gather: the final one of each sequence, then every state_block boundary crossed
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    starts = [0] * num_seqs if start_positions is None else [int(p) for p in start_positions.tolist()]
    out_seq, out_len = list(range(num_seqs)), [int(n) for n in lens]
    b_seq, b_pos = [], []
    if state_block is not None:
        for seq in range(num_seqs):
            first = -(-(starts[seq] + 1) // state_block) * state_block
            for pos in range(first, starts[seq] + out_len[seq] + 1, state_block):
                b_seq.append(seq)
                b_pos.append(pos)
                out_seq.append(seq)
                out_len.append(pos - starts[seq])
    windows = torch.empty(len(out_seq), channels, width, dtype=torch.float32, device=dev)
    if out_seq:
        _window_gather_kernel[(len(out_seq), triton.cdiv(channels, block_d))](
            x, win, windows, cu_seqlens, torch.tensor(out_seq, dtype=torch.int32).to(dev),
            torch.tensor(out_len, dtype=torch.int32).to(dev), channels, width, *x.stride(), *w_strides,
            BLOCK_D=block_d, BLOCK_W=next_pow2(width), HAS_INIT=initial_windows is not None, num_warps=4,
        )
    return ConvVarlenOutput(
        y=y,
        final_windows=windows[:num_seqs],
        boundary_windows=windows[num_seqs:],
        boundary_seq=torch.tensor(b_seq, dtype=torch.int64, device=dev),
        boundary_pos=torch.tensor(b_pos, dtype=torch.int64, device=dev),
    )


@triton.jit
def _conv_update_kernel(
    x_ptr, pool_ptr, slots_ptr, w_ptr, bias_ptr, y_ptr,
    T, D, W, x_b, x_t, x_d, p_s, p_d, p_w, wt_d, wt_k, y_b, y_t, y_d,
    K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
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
    _conv_update_kernel[(batch, triton.cdiv(channels, block_d))](
        x, conv_state_pool, slots, weight, bias if bias is not None else weight, y,
        tokens, channels, width, *x.stride(), *conv_state_pool.stride(), *weight.stride(), *y.stride(),
        K=kernel, BLOCK_D=block_d, BLOCK_W=next_pow2(width), HAS_BIAS=bias is not None,
        SILU=activation is not None, num_warps=4,
    )
    return y
