"""RMSNorm, the residual add fused with the next RMSNorm, the Mamba2 gated RMSNorm (x * silu(z), normalised
per group of channels) and relu2, the elementwise epilogue of the MLP's up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D]; normalise in fp32, scale by weight, return x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32).to(x.dtype)


def gated_rmsnorm_ref(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor | None,  # [..., D] gate
    weight: torch.Tensor,  # [D]
    group_size: int,
    eps: float,
) -> torch.Tensor:
    """Gate first (x * silu(z)), then RMS-normalise each group of `group_size` channels."""
    x32 = x.float()
    if z is not None:
        x32 = x32 * F.silu(z.float())
    *prefix, dim = x32.shape
    if dim % group_size != 0:
        raise ValueError(f"channel count {dim} is not a multiple of group_size {group_size}")
    grouped = x32.view(*prefix, dim // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * grouped.view(*prefix, dim)).to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor,  # [..., D] a block's output
    residual: torch.Tensor,  # [..., D] the residual stream (fp32 with residual_in_fp32, else the hidden dtype)
    weight: torch.Tensor,  # [D] the next norm's weight
    eps: float,
    out: torch.Tensor | None = None,  # [..., D] optional output buffer, weight's dtype
    residual_out: torch.Tensor | None = None,  # [..., D] optional, residual's dtype; may be `residual` itself
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(s) in weight's dtype, s in residual's dtype) with s = residual + x, exactly as the unfused
    pre-norm block computes them: s rounded to the promoted dtype, cast to weight's dtype before the norm."""
    total = residual + x
    normed = rmsnorm_ref(total.to(weight.dtype), weight, eps)
    new_residual = total.to(residual.dtype)
    if out is not None:
        normed = out.copy_(normed)
    if residual_out is not None:
        new_residual = residual_out.copy_(new_residual)
    return normed, new_residual


def relu2_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Squared ReLU (NemotronH's MLP activation) in x's dtype; `out` may be x itself."""
    return torch.square(F.relu(x), out=out)
