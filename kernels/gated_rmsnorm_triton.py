"""Triton gated RMSNorm: y = w * g / rms(g) per group of channels, g = x * silu(z); plain RMSNorm when z is
None and the group is the whole row. One program per (row, group); reads x and z through their strides (z is
a column slice of the in_proj output). Also the residual add fused with the next RMSNorm (one program per
row, writes the normed row and the new residual) and relu2 (elementwise). Reference and contract:
`hybridserve.kernels.gated_rmsnorm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.triton_utils import cdiv, check_same_device, next_pow2, pdl_gate, pdl_launch


@lean_launch
@triton.jit
def _gated_rmsnorm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, group_size, eps, x_m, x_d, z_m, z_d, y_m, y_d,
    BLOCK: tl.constexpr, HAS_Z: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_gate(USE_PDL)
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
            **pdl_launch(x.device),
        )
    return y.reshape(x.shape)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `rmsnorm_ref` (one group spanning the row)."""
    return gated_rmsnorm_triton(x, None, weight, x.shape[-1], eps)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton dtype of a torch floating dtype the kernels support."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; expected float32, bfloat16 or float16")
    return _TL_DTYPES[dtype]


@lean_launch
@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, dim, eps, x_m, x_d, r_m, r_d, y_m, y_d, ro_m, ro_d,
    BLOCK: tl.constexpr, SUM_DTYPE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One row: s = residual + x -> new residual and rmsnorm(s), both stored from one read of the inputs."""
    pdl_gate(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * x_m + offs * x_d, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_m + offs * r_d, mask=mask, other=0.0).to(tl.float32)
    total = (r + x).to(SUM_DTYPE)  # torch's `residual + x`: fp32 math, rounded to the promoted dtype
    tl.store(ro_ptr + row * ro_m + offs * ro_d, total.to(ro_ptr.dtype.element_ty), mask=mask)
    g = total.to(w_ptr.dtype.element_ty).to(tl.float32)  # the norm reads the sum cast to the weight's dtype
    rstd = 1.0 / tl.sqrt(tl.sum(g * g, axis=0) / dim + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_m + offs * y_d, (g * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm_triton(
    x: torch.Tensor,  # [..., D] a block's output
    residual: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    out: torch.Tensor | None = None,  # [..., D] weight's dtype
    residual_out: torch.Tensor | None = None,  # [..., D] residual's dtype; may be `residual` itself
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `add_rmsnorm_ref`: one program per row, one launch for the add and the norm."""
    dim = x.shape[-1]
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if weight.shape != (dim,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({dim},)")
    for name, buf, dtype in (("out", out, weight.dtype), ("residual_out", residual_out, residual.dtype)):
        if buf is not None and (buf.shape != x.shape or buf.dtype != dtype):
            raise ValueError(f"{name} must be {tuple(x.shape)} {dtype}, got {tuple(buf.shape)} {buf.dtype}")
    check_same_device(x, residual, weight, out, residual_out)
    sum_dtype = _tl_dtype(torch.promote_types(residual.dtype, x.dtype))
    for t in (x, residual, weight):
        _tl_dtype(t.dtype)
    normed = torch.empty(x.shape, dtype=weight.dtype, device=x.device) if out is None else out
    new_residual = torch.empty_like(residual) if residual_out is None else residual_out
    x2, r2 = x.reshape(-1, dim), residual.reshape(-1, dim)  # views for 2-D / contiguous-prefix inputs
    y2, ro2 = normed.view(-1, dim), new_residual.view(-1, dim)
    if x2.shape[0]:
        block = next_pow2(dim)
        _add_rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, y2, ro2, dim, eps, *x2.stride(), *r2.stride(), *y2.stride(), *ro2.stride(),
            BLOCK=block, SUM_DTYPE=sum_dtype, num_warps=min(16, max(1, block // 256)),
            **pdl_launch(x.device),
        )
    return normed, new_residual


@lean_launch
@triton.jit
def _relu2_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """BLOCK contiguous elements: y = max(x, 0)^2, fp32 math, rounded once to y's dtype like torch."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu keeps NaN, as torch's does
    tl.store(y_ptr + offs, (x * x).to(y_ptr.dtype.element_ty), mask=mask)


def relu2_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of `relu2_ref`: one elementwise launch instead of relu then square; `out` may be x."""
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    check_same_device(x, out)
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if not (x.is_contiguous() and y.is_contiguous()):  # strided buffers are not the MLP's: keep torch's path
        return torch.square(torch.relu(x), out=y)
    n = x.numel()
    if n:
        _relu2_kernel[(cdiv(n, 1024),)](x, y, n, BLOCK=1024, num_warps=4)
    return y
