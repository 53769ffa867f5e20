"""Triton gated RMSNorm: y = w * g / rms(g) per group of channels, g = x * silu(z); plain RMSNorm when z is
None and the group is the whole row. One program per (row, group); reads x and z through their strides (z is
a column slice of the in_proj output). Reference and contract: `hybridserve.kernels.gated_rmsnorm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.triton_utils import check_same_device, next_pow2


@triton.jit
def _gated_rmsnorm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, group_size, eps, x_m, x_d, z_m, z_d, y_m, y_d,
    BLOCK: tl.constexpr, HAS_Z: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < group_size
    g = tl.load(x_ptr + row * x_m + offs * x_d, mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + row * z_m + offs * z_d, mask=mask, other=0.0).to(tl.float32)
        g = g * z * tl.sigmoid(z)
    rstd = 1.0 / tl.sqrt(tl.sum(g * g, axis=0) / group_size + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_m + offs * y_d, (g * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def gated_rmsnorm_triton(
    x: torch.Tensor,  # [..., D]
    z: torch.Tensor | None,  # [..., D] gate
    weight: torch.Tensor,  # [D]
    group_size: int,
    eps: float,
) -> torch.Tensor:
    """Triton version of `gated_rmsnorm_ref`; returns [..., D] in x's dtype."""
    dim = x.shape[-1]
    if dim % group_size != 0:
        raise ValueError(f"channel count {dim} is not a multiple of group_size {group_size}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"gate shape {tuple(z.shape)} != x shape {tuple(x.shape)}")
    check_same_device(x, z, weight)
    x2 = x.reshape(-1, dim)  # a view for the usual 2-D / contiguous-prefix inputs
    z2 = z.reshape(-1, dim) if z is not None else x2
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = next_pow2(group_size)
        _gated_rmsnorm_kernel[(x2.shape[0], dim // group_size)](
            x2, z2, weight, y, group_size, eps, *x2.stride(), *z2.stride(), *y.stride(),
            BLOCK=block, HAS_Z=z is not None, num_warps=min(16, max(1, block // 256)),
        )
    return y.reshape(x.shape)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `rmsnorm_ref` (one group spanning the row)."""
    return gated_rmsnorm_triton(x, None, weight, x.shape[-1], eps)
