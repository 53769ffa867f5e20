"""FP8 dense linear on CUDA: one Triton kernel quantizes the activations (per-token amax, or a static scale) and
`torch._scaled_mm` multiplies on the fp8 tensor cores (Hopper: cuBLASLt for per-tensor scales, CUTLASS for
row-wise ones), fp32 accumulation, bf16 output. Reference: `fp8_linear.py`.

Hand-written quantization because torch's version is five elementwise kernels (abs, amax, divide, clamp, cast)
per projection, which a decode step of a few rows pays in launches, not bytes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hybridserve.kernels.fp8_linear import FP8, FP8_MAX, FP8_MAX_INV, MIN_SCALE, check_fp8_linear
from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.triton_utils import check_same_device, next_pow2

_MAX_BLOCK = 4096  # columns per pass of the quantization kernel (a row longer than this loops)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_ptr, K, x_m, q_m,
    STATIC: tl.constexpr, BLOCK: tl.constexpr, FP8_LIMIT: tl.constexpr, FP8_LIMIT_INV: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
):
    """One program per row: its scale (amax * (1 / 448), or the static one) and the row quantized with it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, K, BLOCK):
            v = tl.load(x_ptr + row * x_m + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, axis=0) * FP8_LIMIT_INV, SCALE_FLOOR)
    inverse = tl.math.div_rn(1.0, scale)
    tl.store(scale_ptr + row, scale)
    for k in range(0, K, BLOCK):
        mask = k + offs < K
        v = tl.load(x_ptr + row * x_m + k + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(v * inverse, -FP8_LIMIT), FP8_LIMIT)  # saturated: a plain cast past 448 is NaN
        tl.store(q_ptr + row * q_m + k + offs, v.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


_quantize_rows = lean_launch(_quantize_rows_kernel)


def quantize_activation_triton(
    x: torch.Tensor,  # [M, K], rows contiguous
    input_scale: torch.Tensor | None = None,  # [1] fp32 static scale; None: per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `quantize_activation_ref`: (fp8 [M, K], scales [M, 1] fp32), one launch, no host sync."""
    check_same_device(x, input_scale)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(next_pow2(cols), _MAX_BLOCK)
        _quantize_rows[(rows,)](
            x, q, scale, input_scale if input_scale is not None else scale, cols, x.stride(0), q.stride(0),
            STATIC=input_scale is not None, BLOCK=block, FP8_LIMIT=FP8_MAX, FP8_LIMIT_INV=FP8_MAX_INV,
            SCALE_FLOOR=MIN_SCALE,
            num_warps=4 if block >= 1024 else 1,
        )
    return q, scale


def scaled_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` takes these operands: K and N multiples of 16 (its alignment rule), and on a GPU
    bf16 activations and fp8 tensor cores (compute capability 8.9+). CPU tensors (the Triton interpreter,
    kernel mode "interpret") run torch's CPU _scaled_mm, any output dtype."""
    aligned = weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
    if not x.is_cuda:
        return aligned
    return aligned and x.dtype == torch.bfloat16 and _has_fp8_mma(
        x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.cache
def _has_fp8_mma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def fp8_linear_triton(
    x: torch.Tensor,  # [..., K] bf16
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, rows contiguous
    weight_scale: torch.Tensor,  # [1] or [N] fp32
    input_scale: torch.Tensor | None = None,  # [1] fp32 static; None: dynamic per token
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """q(x) @ weight^T scaled, + bias -> [..., N] bf16. Per-tensor activation and weight scales take the tensor-wise
    GEMM; anything per row / channel the row-wise one (scales [M, 1] and [1, N])."""
    check_fp8_linear(x, weight, weight_scale, input_scale, bias)
    out_features, in_features = weight.shape
    x2 = x.reshape(-1, in_features)
    xq, x_scale = quantize_activation_triton(x2, input_scale)
    if input_scale is not None and weight_scale.numel() == 1:
        out = torch._scaled_mm(xq, weight.t(), input_scale.reshape(()), weight_scale.reshape(()), out_dtype=x.dtype)
    else:
        w_scale = weight_scale.float().reshape(1, -1).expand(1, out_features).contiguous()  # a view when [N]
        out = torch._scaled_mm(xq, weight.t(), x_scale, w_scale, out_dtype=x.dtype)
    if bias is not None:  # added apart: the row-wise GEMM takes no bias on every torch release
        out += bias
    return out.view(*x.shape[:-1], out_features)
