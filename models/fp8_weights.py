"""FP8 weights from checkpoints as NVIDIA publishes them (ModelOpt FP8: `*.weight` float8_e4m3fn with a per-tensor
`*.weight_scale` and an `*.input_scale`; compressed-tensors FP8: per-channel `weight_scale` [out, 1]).

Routed expert weights stay fp8 (the fused MoE GEMMs read them as they are, with per-output-channel scales: a
per-tensor scale is broadcast to its rows), their activation scales (`input_scale`) dropped: the expert GEMMs
quantize their inputs per row at run time (W8A8, EngineConfig.moe_fp8_activations) or keep bf16 activations.
Dense fp8 linears: models/fp8_dense.py."""

from __future__ import annotations

import logging

import torch

from hybridserve.kernels.moe import quantize_fp8_rows

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn


def channel_scales(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A checkpoint's weight_scale (scalar, [1], [rows] or [rows, 1]) as fp32 per-row scales [rows]."""
    flat = scale.float().reshape(-1)
    if flat.numel() == 1:
        return flat.expand(rows).clone()
    if flat.numel() == rows:
        return flat
    raise ValueError(
        f"{name} has {flat.numel()} scales for {rows} output channels: only per-tensor and per-channel fp8 scales "
        "are supported (block-wise / NVFP4 checkpoints are not)"
    )


def set_expert_precision(tensors: dict[str, torch.Tensor], fp8: bool | None) -> bool:
    """Make the routed experts (`*.experts.up_proj` / `down_proj`, stacked [E, out, in]) fp8 with `*_scale`
    [E, out] or plain, in place: fp8=None keeps what the checkpoint stores, True quantizes bf16 experts (amax per
    channel), False dequantizes fp8 ones. -> whether the experts are fp8 now."""
    names = [n for n in tensors if n.endswith((".experts.up_proj", ".experts.down_proj"))]
    stored = {tensors[n].dtype == FP8 for n in names}
    if len(stored) > 1:
        raise ValueError("the checkpoint mixes fp8 and unquantized expert weights")
    is_fp8 = stored == {True}
    want = is_fp8 if fp8 is None else fp8
    for name in names:
        if want and not is_fp8:
            tensors[name], tensors[name + "_scale"] = quantize_fp8_rows(tensors[name])
        elif is_fp8 and not want:
            tensors[name] = tensors[name].float() * tensors.pop(name + "_scale")[..., None]
        elif is_fp8 and name + "_scale" not in tensors:
            raise ValueError(f"{name} is fp8 but the checkpoint has no weight_scale for it")
    if names and want != is_fp8:
        logger.info("expert weights %s at load", "quantized to fp8" if want else "dequantized from fp8")
    return bool(names) and want
