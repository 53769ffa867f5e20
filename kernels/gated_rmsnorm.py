"""RMSNorm and the Mamba2 gated RMSNorm (x * silu(z), normalised per group of channels)."""

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
