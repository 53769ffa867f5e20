"""FP8 checkpoints written as ModelOpt and compressed-tensors write them, made from a bf16 / fp32 checkpoint in
the test: every linear quantized (lm_head, the router and anything in `ignore` left as stored), ModelOpt's static
input scales calibrated on transformers' own forward of random prompts (amax / 448 per linear, as its
calibration does)."""

from __future__ import annotations

import fnmatch
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hybridserve.kernels.fp8_linear import FP8_MAX, quantize_weight

LINEAR_LEAVES = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "eh_proj",
                 "fc1_latent_proj", "fc2_latent_proj")
FORMATS = ("modelopt", "compressed-tensors")


def calibrate(hf_model: torch.nn.Module, prompts: list[list[int]]) -> dict[str, float]:
    """amax of every nn.Linear's input over the prompts, by module name without its `model.` / `backbone.`
    prefix (transformers' in-memory names and its checkpoint's differ there)."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in hf_model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def record(mod: torch.nn.Module, args: tuple, name: str = name) -> None:
                amax[_bare(name)] = max(amax.get(_bare(name), 0.0), float(args[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        for prompt in prompts:
            hf_model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return amax


def _bare(name: str) -> str:
    return name.split(".", 1)[1] if name.startswith(("model.", "backbone.")) else name


def quantization_config(fmt: str, ignore: tuple[str, ...] = ()) -> dict:
    """config.json's `quantization_config` of each format (compressed-tensors: per-channel weights, dynamic
    per-token activations, the usual `FP8_DYNAMIC` recipe)."""
    if fmt == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head", *ignore]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", *ignore],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                      "dynamic": False, "symmetric": True},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "dynamic": True, "symmetric": True}}}}


def fp8_checkpoint(source: Path, fmt: str, hf_model: torch.nn.Module | None = None, ignore: tuple[str, ...] = (),
                   prompts: list[list[int]] | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """(a copy of `source` with its linears in fp8 as `fmt` stores them, {checkpoint name: the dequantized fp32
    weight}). ModelOpt needs `hf_model` (and calibration prompts) for its input scales; a linear the calibration
    never reached (an MTP layer transformers does not run) gets the largest calibrated scale."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}")
    directory = Path(tempfile.mkdtemp(prefix=f"hybridserve-fp8-{fmt}-"))
    shutil.copytree(source, directory, dirs_exist_ok=True)
    tensors = load_file(str(directory / "model.safetensors"))
    amax = calibrate(hf_model, prompts or [[1, 2, 3]]) if fmt == "modelopt" and hf_model is not None else {}
    fallback = max(amax.values(), default=FP8_MAX)
    dequantized: dict[str, torch.Tensor] = {}
    for key in [k for k in tensors if k.endswith(".weight")]:
        module = key[: -len(".weight")]
        leaf = module.rsplit(".", 1)[-1]
        skip = any(module.endswith(p) or fnmatch.fnmatchcase(module, p) for p in ignore)
        if leaf not in LINEAR_LEAVES or ".experts." in module or skip:
            continue
        q, scale = quantize_weight(tensors[key], per_channel=fmt == "compressed-tensors")
        tensors[key] = q
        dequantized[key] = q.float() * scale.reshape(-1, 1)
        if fmt == "modelopt":  # 0-dim per-tensor scales, as ModelOpt's export writes them
            tensors[module + ".weight_scale"] = scale.reshape(())
            tensors[module + ".input_scale"] = torch.tensor(amax.get(_bare(module), fallback) / FP8_MAX)
            if leaf in ("k_proj", "v_proj"):  # ModelOpt's FP8 KV cache scales ride on the k / v projections
                tensors[module + "." + leaf[0] + "_scale"] = torch.tensor(1.0)
        else:
            tensors[module + ".weight_scale"] = scale.reshape(-1, 1)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, ignore)
    (directory / "config.json").write_text(json.dumps(config))
    return directory, dequantized
