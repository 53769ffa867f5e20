"""FP8 dense linear layers (W8A8), torch reference: x is quantized to float8_e4m3fn (per token at run time, or
with a checkpoint's static per-tensor `input_scale`), multiplied with an fp8 weight that carries per-tensor or
per-output-channel fp32 scales, accumulated in fp32 and written in x's dtype.

The reference is the oracle for the CUDA path (`fp8_linear_triton.py`: one Triton quantization kernel, then
`torch._scaled_mm`) and the path on CPU: it quantizes the activations exactly as the kernel does (fp32
reciprocal of the scale, saturated to +-448, rounded to nearest even), so both see the same fp8 operands and
differ only in the order of the fp32 accumulation.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
# amax * (1 / 448) rather than amax / 448: torch on CUDA turns a division by a Python scalar into this product
# (on the H200 the quotient differed from it in the last bit) and the Triton kernel does the same, so the
# reference gives the same scales on CPU and CUDA as the kernel
FP8_MAX_INV = 1.0 / FP8_MAX
# a per-token scale never goes below this: an all-zero row (CUDA-graph padding) quantizes to zeros, not NaN
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_activation_ref(
    x: torch.Tensor,  # [M, K]
    input_scale: torch.Tensor | None = None,  # [1] fp32 static scale; None: one scale per row (dynamic)
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x / scale saturated to fp8 [M, K], scale [M, 1] fp32): scale = amax(|row|) * (1 / 448) per row (at least
    MIN_SCALE), or the static scale on every row."""
    xf = x.float()
    if input_scale is None:
        scale = torch.clamp_min(xf.abs().amax(dim=-1, keepdim=True) * FP8_MAX_INV, MIN_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    inverse = 1.0 / scale
    return torch.clamp(xf * inverse, -FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def check_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """ValueError unless the operands fit: fp8 [N, K] weight, [1] or [N] weight scales, [1] input scale."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise ValueError(f"fp8_linear wants a float8_e4m3fn [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match weight {tuple(weight.shape)} (want [N, K])")
    if weight_scale.numel() not in (1, out_features):
        raise ValueError(f"weight_scale has {weight_scale.numel()} values for {out_features} output channels "
                         "(want 1 per tensor or 1 per channel)")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"input_scale must be one per-tensor value, got {input_scale.numel()}")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")


def fp8_linear_ref(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [1] or [N] fp32
    input_scale: torch.Tensor | None = None,  # [1] fp32 static; None: dynamic per token
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """(q(x) @ weight^T) * x_scale * weight_scale + bias, fp32 math, [..., N] in x's dtype."""
    check_fp8_linear(x, weight, weight_scale, input_scale, bias)
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_activation_ref(x2, input_scale)
    out = (xq.float() @ weight.float().t()) * x_scale * weight_scale.float().reshape(1, -1)  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def quantize_weight(
    weight: torch.Tensor, per_channel: bool  # [N, K] any float dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weight / scale as float8_e4m3fn [N, K], scale [N] or [1] fp32), scale = amax / 448 per output row or
    over the tensor: how ModelOpt (per tensor) and compressed-tensors (per channel) store fp8 weights."""
    wf = weight.float()
    amax = wf.abs().amax(dim=1) if per_channel else wf.abs().amax().reshape(1)
    scale = torch.clamp_min(amax / FP8_MAX, MIN_SCALE)
    return torch.clamp(wf / scale.reshape(-1, 1), -FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 [N, K] * scale ([1] or [N]) -> fp32 [N, K]."""
    return weight.float() * scale.float().reshape(-1, 1)
