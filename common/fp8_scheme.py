"""What a checkpoint's `quantization_config` says about FP8 weights: the method, how activations are scaled and
which modules stay unquantized, read from config.json without torch.

Formats understood (the two NVIDIA and the Hugging Face FP8 checkpoints are published in):
  ModelOpt (`quant_method: modelopt`, `quant_algo: FP8`): float8_e4m3fn `weight`, per-tensor fp32 `weight_scale`
      and a calibrated per-tensor `input_scale` (static activations); `exclude_modules` (or `ignore`) lists glob
      patterns of module names left in bf16 (the router gates, lm_head, ...). `FP8_PER_CHANNEL_PER_TOKEN`:
      per-channel weight scales, per-token activations.
  compressed-tensors (`quant_method: compressed-tensors`, `format: float-quantized`): `config_groups` with 8-bit
      float `weights` (strategy `tensor` or `channel`: a `weight_scale` [1] or [out, 1]) and `input_activations`
      (strategy `token` with `dynamic: true`: scaled per token at run time, or `tensor` with a stored
      `input_scale`); `ignore` lists module names or `re:`-prefixed regular expressions.
  transformers `quant_method: fp8` without `weight_block_size`: per-tensor or per-channel weights, dynamic
      activations. Block-wise FP8 and NVFP4 are refused with a ValueError that names the field.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

ACTIVATION_SCHEMES = ("static", "dynamic")
_PREFIXES = ("", "model.", "backbone.")  # checkpoints name modules with one of these before ours


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 weights as config.json declares them."""

    method: str  # "modelopt" | "compressed-tensors" | "fp8"
    activation: str  # "static": a calibrated per-tensor input_scale; "dynamic": per-token scales at run time
    per_channel: bool  # weight scales per output channel (else per tensor)
    ignore: tuple[str, ...] = ()  # patterns of modules left unquantized, as the checkpoint spells them

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation scheme must be one of {ACTIVATION_SCHEMES}, got {self.activation!r}")

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (our name, no `model.` / `backbone.` prefix) holds fp8 weights."""
        names = [prefix + module for prefix in _PREFIXES]
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if any(re.match(pattern[3:], name) for name in names):
                    return False
            elif any(name == pattern or fnmatch.fnmatchcase(name, pattern) for name in names):
                return False
        return True


def _unsupported(method: str, what: str) -> ValueError:
    return ValueError(
        f"config field `quantization_config` ({method or '?'}: {what}) is not supported: bf16 / fp16 checkpoints and "
        "FP8 e4m3 with per-tensor or per-channel weight scales (ModelOpt FP8, compressed-tensors float-quantized) are"
    )


def _compressed_tensors(quant: dict[str, Any]) -> Fp8Scheme:
    groups = [g for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)]
    if not groups:
        raise _unsupported("compressed-tensors", "no `config_groups`")
    weights = [g.get("weights") or {} for g in groups]
    if not all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
        raise _unsupported("compressed-tensors", "weights other than 8-bit float")
    strategies = {str(w.get("strategy", "tensor")) for w in weights}
    if not strategies <= {"tensor", "channel"} or len(strategies) > 1:
        raise _unsupported("compressed-tensors", f"weight strategy {sorted(strategies)}; use tensor or channel")
    acts = [g.get("input_activations") for g in groups]
    if any(a is not None and not (a.get("type", "float") == "float" and a.get("num_bits", 8) == 8) for a in acts):
        raise _unsupported("compressed-tensors", "activations other than 8-bit float")
    # weight-only groups (no input_activations) run with per-token activations as the W8A8 ones do
    static = {a is not None and not a.get("dynamic", False) for a in acts}
    if len(static) > 1:
        raise _unsupported("compressed-tensors", "static and dynamic activation groups mixed")
    return Fp8Scheme("compressed-tensors", "static" if static == {True} else "dynamic", strategies == {"channel"},
                     tuple(str(p) for p in quant.get("ignore") or ()))


def parse_fp8_scheme(data: dict[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json dict (None: no `quantization_config`); any other scheme is a ValueError."""
    quant = data.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"config field `quantization_config` must be an object, got {quant!r}")
    method = str(quant.get("quant_method", "")).lower()
    algo = str(quant.get("quant_algo", "")).upper()
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "fp8":
        if quant.get("weight_block_size"):
            raise _unsupported(method, f"block-wise weight scales {quant['weight_block_size']}")
        scheme = str(quant.get("activation_scheme", "dynamic"))
        return Fp8Scheme("fp8", scheme, True, tuple(str(p) for p in quant.get("modules_to_not_convert") or ()))
    # ModelOpt (config.json, or hf_quant_config.json's `quantization` block copied in); newer exports name the
    # exclusions `ignore`, as compressed-tensors does
    excluded = tuple(str(p) for p in quant.get("exclude_modules") or quant.get("ignore") or ())
    if algo == "FP8":
        return Fp8Scheme("modelopt", "static", False, excluded)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return Fp8Scheme("modelopt", "dynamic", True, excluded)
    raise _unsupported(method, algo or "no quant_algo")
