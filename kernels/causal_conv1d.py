"""Depthwise causal conv1d with a rolling window state, for prefill (varlen) and decode/verify (T tokens).

A window holds the last W >= K-1 inputs, oldest first ([D, W]); the conv reads its last K-1 columns.
Keeping W = K-1+K_spec columns lets speculative decoding roll back by reading at an offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


@dataclass(frozen=True)
class ConvVarlenOutput:
    """What one varlen prefill conv returns."""

    y: torch.Tensor  # [T, D] activated conv output, dtype of x
    final_windows: torch.Tensor  # [S, D, W] fp32, the last W inputs of each sequence
    boundary_windows: torch.Tensor  # [K, D, W] fp32, windows at absolute multiples of state_block
    boundary_seq: torch.Tensor  # [K] int64, sequence of each boundary window
    boundary_pos: torch.Tensor  # [K] int64, absolute token count at that boundary


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
) -> ConvVarlenOutput:
    """Prefill conv per sequence (fp32 math)."""
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
        out, _ = _conv_with_window(window[:, width - (kernel - 1) :], x[begin:end].float(), w32, b32)
        y[begin:end] = out
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
