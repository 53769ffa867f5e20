"""Depthwise causal conv1d with a rolling window state, for prefill (varlen) and decode/verify (T tokens).

A window holds the last W >= K-1 inputs, oldest first ([D, W]); the conv reads its last K-1 columns.
Keeping W = K-1+K_spec columns lets speculative decoding roll back by reading at an offset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from hybridserve.kernels.host_index import pack_to_device


def _conv_with_window(
    window: torch.Tensor,  # [D, K-1] fp32, inputs before the first new token
    x: torch.Tensor,  # [L, D] fp32
    weight: torch.Tensor,  # [D, K] fp32
    bias: torch.Tensor | None,  # [D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (conv output [L, D] before activation, all inputs [D, K-1+L])."""
    full = torch.cat([window, x.T], dim=1)
    out = F.conv1d(full[None], weight[:, None, :], bias, groups=weight.shape[0])[0]  # [D, L]
    return out.T, full


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r}; expected 'silu' or None")


def _is_int(t: torch.Tensor) -> bool:
    """True for integer (index) tensors."""
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def check_conv_pool_args(
    x: torch.Tensor,  # [T, D]
    cu_seqlens: torch.Tensor,  # [S + 1]
    initial_windows: torch.Tensor | None,
    window_width: int | None,
    conv_pool: torch.Tensor | None,  # [rows, D, W]
    slots: torch.Tensor | None,  # [S]
    boundary_rows: torch.Tensor | None,  # [K]
) -> None:
    """Raise ValueError on a malformed conv_pool / slots / boundary_rows combination (shared by ref and Triton)."""
    if conv_pool is None:
        raise ValueError("slots and boundary_rows are only used together with conv_pool")
    if initial_windows is not None:
        raise ValueError("pass either initial_windows or conv_pool (with slots), not both")
    if conv_pool.dim() != 3 or conv_pool.shape[1] != x.shape[1] or not conv_pool.is_floating_point():
        raise ValueError(f"conv_pool must be a float [rows, D={x.shape[1]}, W] tensor, got {conv_pool.dtype} "
                         f"{tuple(conv_pool.shape)}")
    if window_width is not None and window_width != conv_pool.shape[2]:
        raise ValueError(f"window_width {window_width} disagrees with conv_pool's width {conv_pool.shape[2]}")
    num_seqs = cu_seqlens.numel() - 1
    if slots is None:
        raise ValueError("slots is required with conv_pool (the pool row of each sequence)")
    if slots.dim() != 1 or slots.numel() != num_seqs or not _is_int(slots):
        raise ValueError(f"slots must be an integer [S={num_seqs}] tensor, got {slots.dtype} {tuple(slots.shape)}")
    if boundary_rows is not None and (boundary_rows.dim() != 1 or not _is_int(boundary_rows)):
        raise ValueError(f"boundary_rows must be an integer [K] tensor, got {boundary_rows.dtype} "
                         f"{tuple(boundary_rows.shape)}")


def check_boundary_rows(boundary_rows: torch.Tensor | None, num_boundaries: int) -> None:
    """Raise ValueError when boundary_rows does not have one entry per state_block boundary crossed."""
    if boundary_rows is not None and boundary_rows.numel() != num_boundaries:
        raise ValueError(f"boundary_rows has {boundary_rows.numel()} entries but the sequences cross "
                         f"{num_boundaries} state_block boundaries")


@dataclass(frozen=True)
class ConvVarlenOutput:
    """What one varlen prefill conv returns. When the call was given `conv_pool`, the windows went straight into
    the pool and `final_windows` / `boundary_windows` are empty ([0, D, W])."""

    y: torch.Tensor  # [T, D] activated conv output, dtype of x
    final_windows: torch.Tensor  # [S, D, W] fp32, the last W inputs of each sequence ([0, D, W] with conv_pool)
    boundary_windows: torch.Tensor  # [K, D, W] fp32, windows at absolute multiples of state_block (same)
    boundary_seq: torch.Tensor  # [K] int64, sequence of each boundary window
    boundary_pos: torch.Tensor  # [K] int64, absolute token count at that boundary


@dataclass(frozen=True)
class ConvVarlenMeta:
    """Host-derived indices of one packed prefill batch for the varlen conv: which windows to gather (the final
    one of each sequence, then every state_block boundary crossed). A forward builds it once from host lists
    (`conv_varlen_metadata`) and hands it to every Mamba layer, so the layers launch without host syncs."""

    seq_lens: list[int]  # [S] tokens per sequence
    boundary_seq: list[int]  # [K] sequence of each boundary window
    boundary_pos: list[int]  # [K] absolute token count at that boundary
    boundary_len: list[int]  # [K] tokens of the sequence's chunk before the boundary
    token_seq: torch.Tensor  # [T] int64 sequence of each packed token
    gather_seq: torch.Tensor  # [S + K] int32: 0..S-1 then boundary_seq (the windows to gather, in that order)
    gather_len: torch.Tensor  # [S + K] int32: seq_lens then boundary_len
    final_seq: torch.Tensor  # [S] int32 0..S-1 (the final windows alone)
    final_len: torch.Tensor  # [S] int32 seq_lens
    boundary_seq_i32: torch.Tensor  # [K] int32 (the boundary windows alone)
    boundary_len_i32: torch.Tensor  # [K] int32
    boundary_seq_t: torch.Tensor  # [K] int64
    boundary_pos_t: torch.Tensor  # [K] int64


def conv_varlen_metadata(
    seq_lens: list[int], starts: list[int] | None, state_block: int | None, device: torch.device
) -> ConvVarlenMeta:
    """`ConvVarlenMeta` from host lists: new tokens and absolute start position (None: all 0) per sequence."""
    if state_block is not None and state_block <= 0:
        raise ValueError(f"state_block must be positive, got {state_block}")
    num_seqs = len(seq_lens)
    starts = [0] * num_seqs if starts is None else starts
    if len(starts) != num_seqs:
        raise ValueError(f"start_positions has {len(starts)} entries for {num_seqs} sequences")
    b_seq: list[int] = []
    b_pos: list[int] = []
    b_len: list[int] = []
    if state_block is not None:
        for seq in range(num_seqs):
            first = -(-(starts[seq] + 1) // state_block) * state_block
            for pos in range(first, starts[seq] + seq_lens[seq] + 1, state_block):
                b_seq.append(seq)
                b_pos.append(pos)
                b_len.append(pos - starts[seq])
    token_seq = [seq for seq, n in enumerate(seq_lens) for _ in range(n)]
    token_seq_t, b_seq_t, b_pos_t = pack_to_device([token_seq, b_seq, b_pos], torch.int64, device)
    final_seq, final_len, gather_seq, gather_len, boundary_seq, boundary_len = pack_to_device(
        [list(range(num_seqs)), seq_lens, list(range(num_seqs)) + b_seq, list(seq_lens) + b_len, b_seq, b_len],
        torch.int32, device,
    )
    return ConvVarlenMeta(
        seq_lens=list(seq_lens), boundary_seq=b_seq, boundary_pos=b_pos, boundary_len=b_len,
        token_seq=token_seq_t, boundary_seq_t=b_seq_t, boundary_pos_t=b_pos_t, gather_seq=gather_seq,
        gather_len=gather_len, final_seq=final_seq, final_len=final_len, boundary_seq_i32=boundary_seq,
        boundary_len_i32=boundary_len,
    )


def causal_conv1d_varlen_ref(
    x: torch.Tensor,  # [T, D] packed tokens
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,  # [D]
    cu_seqlens: torch.Tensor,  # [S + 1]
    initial_windows: torch.Tensor | None = None,  # [S, D, W], W >= K-1; None means zeros (fresh sequences)
    activation: str | None = "silu",
    window_width: int | None = None,  # W when initial_windows is None (default K-1)
    start_positions: torch.Tensor | None = None,  # [S] absolute position of each sequence's first token
    state_block: int | None = None,  # also return the windows at absolute multiples of this
    *,
    conv_pool: torch.Tensor | None = None,  # [rows, D, W] any float dtype / strides: windows read and written here
    slots: torch.Tensor | None = None,  # [S] int64 pool row of each sequence (initial window if resumed, final)
    boundary_rows: torch.Tensor | None = None,  # [K] int64 pool row of each boundary window, -1 = don't write
    meta: ConvVarlenMeta | None = None,  # unused here (the Triton launcher's precomputed indices)
) -> ConvVarlenOutput:
    """Prefill conv per sequence (fp32 math). With `conv_pool`, resumed sequences (start_positions > 0) read
    their initial window from conv_pool[slots], and the final / boundary windows are written into the pool
    (slot rows distinct, and distinct from the boundary rows)."""
    if conv_pool is not None or slots is not None or boundary_rows is not None:
        check_conv_pool_args(x, cu_seqlens, initial_windows, window_width, conv_pool, slots, boundary_rows)
        assert conv_pool is not None and slots is not None  # checked above
        num_seqs = cu_seqlens.numel() - 1
        resumed = torch.zeros(num_seqs, dtype=torch.bool, device=x.device)
        if start_positions is not None:
            resumed = start_positions.to(x.device) > 0
        windows = torch.where(resumed[:, None, None], conv_pool[slots].float(), 0.0)  # [S, D, W]
        out = causal_conv1d_varlen_ref(x, weight, bias, cu_seqlens, windows, activation, None, start_positions,
                                       state_block)
        check_boundary_rows(boundary_rows, out.boundary_seq.numel())
        conv_pool[slots] = out.final_windows.to(conv_pool.dtype)
        if boundary_rows is not None:
            keep = boundary_rows >= 0
            conv_pool[boundary_rows[keep]] = out.boundary_windows[keep].to(conv_pool.dtype)
        empty = torch.empty(0, x.shape[1], conv_pool.shape[2], dtype=torch.float32, device=x.device)
        return replace(out, final_windows=empty, boundary_windows=empty)
    kernel = weight.shape[1]
    num_seqs = cu_seqlens.numel() - 1
    if initial_windows is not None:
        width = initial_windows.shape[-1]
    else:
        width = kernel - 1 if window_width is None else window_width
    if width < kernel - 1:
        raise ValueError(f"conv window width {width} is smaller than conv_kernel-1 = {kernel - 1}")
    if state_block is not None and state_block <= 0:
        raise ValueError(f"state_block must be positive, got {state_block}")
    bounds = cu_seqlens.tolist()
    starts = [0] * num_seqs if start_positions is None else [int(p) for p in start_positions.tolist()]
    w32 = weight.float()
    b32 = None if bias is None else bias.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    finals = torch.empty(num_seqs, x.shape[1], width, dtype=torch.float32, device=x.device)
    boundary_windows: list[torch.Tensor] = []
    boundary_seq: list[int] = []
    boundary_pos: list[int] = []
    for seq in range(num_seqs):
        begin, end = bounds[seq], bounds[seq + 1]
        if initial_windows is None:
            window = torch.zeros(x.shape[1], width, dtype=torch.float32, device=x.device)
        else:
            window = initial_windows[seq].float()
        seq_out, _ = _conv_with_window(window[:, width - (kernel - 1) :], x[begin:end].float(), w32, b32)
        y[begin:end] = seq_out
        history = torch.cat([window, x[begin:end].float().T], dim=1)  # [D, W + L]
        finals[seq] = history[:, history.shape[1] - width :]
        if state_block is not None:
            first = -(-(starts[seq] + 1) // state_block) * state_block
            for pos in range(first, starts[seq] + end - begin + 1, state_block):
                stop = width + pos - starts[seq]  # columns of history up to and including token `pos - 1`
                boundary_windows.append(history[:, stop - width : stop])
                boundary_seq.append(seq)
                boundary_pos.append(pos)
    empty = torch.empty(0, x.shape[1], width, dtype=torch.float32, device=x.device)
    return ConvVarlenOutput(
        y=_activate(y, activation).to(x.dtype),
        final_windows=finals,
        boundary_windows=torch.stack(boundary_windows) if boundary_windows else empty,
        boundary_seq=torch.tensor(boundary_seq, dtype=torch.int64, device=x.device),
        boundary_pos=torch.tensor(boundary_pos, dtype=torch.int64, device=x.device),
    )


def causal_conv1d_update_ref(
    x: torch.Tensor,  # [B, T, D]
    conv_state_pool: torch.Tensor,  # [num_slots, D, W], W >= K-1; updated in place at `slots`
    slots: torch.Tensor,  # [B], -1 = padded row
    weight: torch.Tensor,  # [D, K]
    bias: torch.Tensor | None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Decode / verify update of T tokens per sequence; returns y [B, T, D] in x's dtype."""
    kernel = weight.shape[1]
    width = conv_state_pool.shape[-1]
    if width < kernel - 1:
        raise ValueError(f"conv state width {width} is smaller than conv_kernel-1 = {kernel - 1}")
    valid = slots >= 0
    safe_slots = slots.clamp(min=0).long()
    windows = conv_state_pool[safe_slots].float()  # [B, D, W]
    full = torch.cat([windows, x.float().transpose(1, 2)], dim=2)  # [B, D, W+T]
    num_seqs, channels, _ = full.shape
    conv_in = full[:, :, width - (kernel - 1) :].reshape(1, num_seqs * channels, -1)
    out = F.conv1d(
        conv_in,
        weight.float().repeat(num_seqs, 1)[:, None, :],
        None if bias is None else bias.float().repeat(num_seqs),
        groups=num_seqs * channels,
    ).reshape(num_seqs, channels, -1)
    y = _activate(out.transpose(1, 2), activation)
    y = torch.where(valid[:, None, None], y, torch.zeros_like(y))
    if bool(valid.any()):
        conv_state_pool[safe_slots[valid]] = full[valid][:, :, -width:].to(conv_state_pool.dtype)
    return y.to(x.dtype)
