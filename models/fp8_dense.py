"""Dense fp8 linears at load: which `Linear`s hold fp8 weights, their modules turned fp8 on the meta model, and
the checkpoint's scales in the shapes the op takes.

A checkpoint decides by its tensors: a linear whose `weight` is float8_e4m3fn with a `weight_scale` stays fp8
(its quantization_config's ignore / exclude lists are what it stored in bf16); dummy weights follow the
quantization_config's patterns. Kept in the model dtype whatever the checkpoint stores, as vLLM does: lm_head
(the vocab projection), the routed-expert router (not a Linear here), and q/k/v unless all three are fp8 (they run
as one fused GEMM). An fp8 weight nothing here can run (those, a conv) is dequantized with its scale.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hybridserve.common.fp8_scheme import Fp8Scheme
from hybridserve.kernels.fp8_linear import FP8, dequantize_weight, quantize_weight
from hybridserve.models.fp8_weights import channel_scales
from hybridserve.models.layers import Linear
from hybridserve.models.moe import MoE

logger = logging.getLogger(__name__)

NEVER_FP8 = ("lm_head",)
_QKV = ("q_proj", "k_proj", "v_proj")
# the static activation scale of dummy fp8 linears: inputs up to +-8 before saturating (benchmarks' random weights)
DUMMY_INPUT_SCALE = 8.0 / 448.0


def linear_modules(model: nn.Module) -> dict[str, Linear]:
    """Every Linear of the model by its parameter prefix."""
    return {name: module for name, module in model.named_modules() if isinstance(module, Linear)}


def _consistent(names: set[str], linears: dict[str, Linear]) -> set[str]:
    """names less lm_head and any q/k/v group that is not fp8 as a whole."""
    names = {n for n in names if n not in NEVER_FP8}
    for name in [n for n in linears if n.endswith(".q_proj")]:
        group = {name[: -len("q_proj")] + proj for proj in _QKV}
        if not group <= names:
            names -= group
    return names


def checkpoint_fp8_linears(state: dict[str, torch.Tensor], linears: dict[str, Linear]) -> set[str]:
    """The linears the checkpoint stores as fp8 weights with a weight_scale (and that run in fp8 here)."""
    stored = {n for n in linears if n + ".weight_scale" in state and getattr(state.get(n + ".weight"), "dtype", None) == FP8}
    return _consistent(stored, linears)


def scheme_fp8_linears(scheme: Fp8Scheme, linears: dict[str, Linear]) -> set[str]:
    """The linears a quantization_config declares fp8 (its ignore / exclude patterns left out)."""
    return _consistent({n for n in linears if scheme.quantizes(n)}, linears)


def prepare_dense_state(state: dict[str, torch.Tensor], model: nn.Module, keep_fp8: bool = True) -> set[str]:
    """In place on a checkpoint's tensors (our names): the fp8 linears' scales as the op takes them (weight_scale
    [1] or [out] fp32, [out] when activations are scaled per token; input_scale [1]); every other fp8 weight
    dequantized; activation and KV-cache scales of everything else dropped. `keep_fp8=False` dequantizes all
    dense fp8 weights (the bf16 path). -> the fp8 linears, for `to_fp8`."""
    linears = linear_modules(model)
    fp8 = checkpoint_fp8_linears(state, linears) if keep_fp8 else set()
    for name in fp8:
        weight = state[name + ".weight"]
        scale = channel_scales(state[name + ".weight_scale"], weight.shape[0], name + ".weight_scale")
        static = name + ".input_scale" in state
        per_tensor = bool((scale == scale[0]).all())
        state[name + ".weight_scale"] = scale[:1].clone() if per_tensor and static else scale
        if static:
            input_scale = state[name + ".input_scale"].float().reshape(-1)
            if input_scale.numel() != 1:
                raise ValueError(f"{name}.input_scale has {input_scale.numel()} values: only per-tensor static "
                                 "activation scales are supported (per-token ones are computed at run time)")
            state[name + ".input_scale"] = input_scale
    for key in list(state):
        module, _, leaf = key.rpartition(".")
        if module in fp8:
            continue
        if leaf == "weight_scale_2":
            raise ValueError(f"{key}: NVFP4 checkpoints are not supported (fp8 and bf16 are)")
        if leaf == "weight" and key + "_scale" in state:
            scale = channel_scales(state[key + "_scale"], state[key].shape[0], key + "_scale")
            weight = state[key]
            state[key] = dequantize_weight(weight.reshape(weight.shape[0], -1), scale).reshape(weight.shape)
        elif leaf == "weight" and state[key].dtype == FP8:
            raise ValueError(f"{key} is fp8 but the checkpoint has no {key}_scale for it: re-export it with its "
                             "weight scales, or in bf16")
    for key in list(state):
        if key.endswith((".k_scale", ".v_scale")) or (
                key.endswith((".input_scale", ".weight_scale")) and key.rpartition(".")[0] not in fp8):
            del state[key]  # the KV cache's scales (fp8 KV pages scale by 1.0), unquantized modules' activations
    return fp8


def stored_layout(fp8: set[str], state: dict[str, torch.Tensor]) -> dict[str, tuple[bool, bool]]:
    """{linear: (per-channel weight scales, static input scale)} as `state` (after prepare_dense_state) holds them."""
    return {n: (state[n + ".weight_scale"].numel() > 1, n + ".input_scale" in state) for n in fp8}


def scheme_layout(fp8: set[str], scheme: Fp8Scheme) -> dict[str, tuple[bool, bool]]:
    """The same for dummy weights of `scheme` (what `dummy_fp8_state` makes)."""
    return {n: (scheme.per_channel or scheme.activation == "dynamic", scheme.activation == "static") for n in fp8}


def to_fp8(model: nn.Module, layout: dict[str, tuple[bool, bool]]) -> None:
    """Turn the meta model's linears named in `layout` into fp8 linears of that (per_channel, static) layout."""
    linears = linear_modules(model)
    for name, (per_channel, static) in sorted(layout.items()):
        linears[name].to_fp8(per_channel=per_channel, static_input=static)
    _unfuse_fp8_shared_experts(model)
    if layout:
        statics = sum(static for _, static in layout.values())
        logger.info("%d of %d linears keep fp8 weights (%d with static activation scales, %d per token)",
                    len(layout), len(linears), statics, len(layout) - statics)


def _unfuse_fp8_shared_experts(model: nn.Module) -> None:
    """An fp8 shared expert runs as its own linears, not as chunks inside the (bf16) routed-expert GEMMs."""
    for module in model.modules():
        if isinstance(module, MoE) and module.shared_chunks and module.shared_experts.up_proj.is_fp8:
            module.shared_chunks = 0
            module.gate.spec = type(module.gate.spec)(**{**vars(module.gate.spec), "num_shared": 0})


def dummy_fp8_state(
    name: str, weight: torch.Tensor, scheme: Fp8Scheme  # a linear's prefix and its random fp32 weight [out, in]
) -> dict[str, torch.Tensor]:
    """The tensors an fp8 checkpoint of `scheme` would store for this weight: fp8 weight, its scales (per channel
    when the scheme says so or activations are per token), a static input scale when the scheme has one."""
    per_channel = scheme.per_channel or scheme.activation == "dynamic"
    fp8_weight, scale = quantize_weight(weight, per_channel)
    out = {name + ".weight": fp8_weight, name + ".weight_scale": scale}
    if scheme.activation == "static":
        out[name + ".input_scale"] = torch.full((1,), DUMMY_INPUT_SCALE, device=weight.device)
    return out
