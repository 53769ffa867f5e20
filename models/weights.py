"""Load a transformers checkpoint directory (safetensors, single file or sharded) into a `HybridLM`."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from hybridserve.common.model_config import ModelConfig
from hybridserve.kernels.ops import AUTO_KERNELS, Kernels
from hybridserve.models.fp8_dense import (
    dummy_fp8_state,
    linear_modules,
    prepare_dense_state,
    scheme_fp8_linears,
    scheme_layout,
    stored_layout,
    to_fp8,
)
from hybridserve.models.fp8_weights import FP8, channel_scales, set_expert_precision
from hybridserve.models.hybrid_model import HybridLM

logger = logging.getLogger(__name__)

_PREFIXES = ("model.", "backbone.")
_EXPERT_KEY = re.compile(
    r"^((?:mtp\.)?layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.(weight|weight_scale|input_scale)$"
)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no `weight_map`")
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shard files that do not exist: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{model_dir} has no model.safetensors nor model.safetensors.index.json")


def _normalize(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint under our parameter names (per-expert tensors stacked; dense fp8 weights as
    stored: `prepare_dense_state` decides what stays fp8 once the model is built)."""
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    files = checkpoint_files(model_dir)
    for path in tqdm(files, desc="loading weights", unit="file", disable=len(files) < 2):
        with safe_open(str(path), framework="pt") as handle:
            for raw_name in handle.keys():
                name = _normalize(raw_name)
                match = _EXPERT_KEY.match(name)
                if match:
                    # activation scales dropped: the expert GEMMs scale their input rows at run time (W8A8) or
                    # keep bf16 activations
                    if match[4] != "input_scale":
                        key = (match[1], match[3], match[4])
                        experts.setdefault(key, {})[int(match[2])] = handle.get_tensor(raw_name)
                else:
                    tensors[name] = handle.get_tensor(raw_name)
    for (prefix, proj, kind), per_expert in experts.items():
        if kind == "weight":
            tensors[f"{prefix}.{proj}"] = torch.stack([per_expert[i] for i in sorted(per_expert)])
        else:  # fp8 scales, per expert tensor or per output channel -> [E, out]
            rows = experts[(prefix, proj, "weight")][0].shape[0]
            name = f"{prefix}.{proj}_scale"
            tensors[name] = torch.stack([channel_scales(per_expert[i], rows, name) for i in sorted(per_expert)])
    return tensors


def load_model(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, with_mtp: bool = True,
    moe_fp8: bool | None = None, dense_fp8: bool = True, kernels: Kernels = AUTO_KERNELS,
) -> HybridLM:
    """Build the model on `device` in `dtype` and fill it from the checkpoint; missing or unexpected
    tensors and shape mismatches raise a ValueError that names them. `with_mtp=False` leaves out the MTP
    drafter (and its KV) even when the checkpoint has one. `moe_fp8`: routed expert weights in fp8 (True:
    quantized at load when stored in bf16), dequantized (False), or as the checkpoint stores them (None).
    `dense_fp8`: every other linear the checkpoint stores in fp8 stays fp8 (W8A8 through `ops.fp8_linear`), or
    (False) is dequantized to the model dtype. `kernels`: the kernel mode its layers run their ops in."""
    model_dir = Path(model_dir)
    state = read_state_dict(model_dir)
    if config.moe is not None:
        fp8 = set_expert_precision(state, moe_fp8)
        config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, fp8_experts=fp8))
    has_mtp_weights = any(name.startswith("mtp.") for name in state)
    if config.has_mtp and not has_mtp_weights:
        logger.info("%s declares an MTP module but ships no `mtp.*` weights: loading without MTP", model_dir)
        config = dataclasses.replace(config, mtp_layer_types=())
    elif has_mtp_weights and not config.has_mtp:
        logger.warning("%s has `mtp.*` weights but no `num_nextn_predict_layers`: ignoring them", model_dir)
    if not with_mtp and config.has_mtp:
        config = dataclasses.replace(config, mtp_layer_types=())
    if not config.has_mtp:
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    if "lm_head.weight" not in state and config.tie_word_embeddings and "embeddings.weight" in state:
        state["lm_head.weight"] = state["embeddings.weight"]
    with torch.device("meta"):
        model = HybridLM(config, kernels)
    to_fp8(model, stored_layout(prepare_dense_state(state, model, dense_fp8), state))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors the config needs: {missing[:8]}")
    if unexpected:
        raise ValueError(f"checkpoint {model_dir} has tensors the config does not describe: {unexpected[:8]}")
    for name, ref in expected.items():
        if tuple(state[name].shape) != tuple(ref.shape):
            raise ValueError(
                f"tensor {name} in {model_dir} has shape {tuple(state[name].shape)}, config implies {tuple(ref.shape)}"
            )
    model = model.to_empty(device=device)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        tensor.data = state[name].to(device=device, dtype=_load_dtype(name, state[name], dtype))
    logger.info("loaded %s (%s, %d layers, pattern %s)", model_dir, config.architecture, config.num_layers, config.pattern)
    return model.eval()


_KEEP_FP32 = ("A_log", "D", "dt_bias", "e_score_correction_bias", "up_proj_scale", "down_proj_scale", "weight_scale",
              "input_scale")


def _load_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """SSM constants, the router (transformers keeps it fp32) and fp8 scales stay fp32, fp8 weights (experts,
    dense linears) fp8, the rest the model dtype."""
    if name.rsplit(".", 1)[-1] in _KEEP_FP32 or name.endswith("mixer.gate.weight"):  # the router runs in fp32
        return torch.float32
    return FP8 if tensor.dtype == FP8 else dtype


def dummy_values(name: str, shape: tuple[int, ...], device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """Random fp32 values in sane ranges for the parameter `name` (decays in (0, 1), unit norms); drawn in
    parameter order from one generator, so a tensor-parallel shard can slice the same values."""
    leaf = name.rsplit(".", 1)[-1]
    values = torch.empty(shape, dtype=torch.float32, device=device)
    if leaf == "A_log":
        values = torch.log(torch.rand(shape, device=device, generator=generator) * 15 + 1)
    elif leaf == "dt_bias":
        values = torch.rand(shape, device=device, generator=generator) - 4
    elif leaf in ("D", "e_score_correction_bias", "up_proj_scale", "down_proj_scale"):
        values.fill_(0.0 if leaf == "e_score_correction_bias" else 1.0)
    elif "norm" in name:
        values.fill_(1.0)
    else:
        values.normal_(0, 0.02, generator=generator)
    return values


def dummy_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                kernels: Kernels = AUTO_KERNELS) -> HybridLM:
    """A model with random weights in sane ranges (decays in (0, 1), unit norms) built from the config
    alone: benchmarks of real shapes without reading (or owning) a checkpoint. With an fp8 quantization_config
    the linears it declares fp8 hold quantized random weights (as a checkpoint of that scheme would)."""
    with torch.device("meta"):
        model = HybridLM(config, kernels)
    fp8 = dummy_fp8_linears(model, config)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module in fp8 and leaf in ("weight_scale", "input_scale"):
            continue  # set with the weight
        if module in fp8 and leaf == "weight":  # the bf16 weight's draw, quantized; its scales set with it
            assert config.fp8 is not None  # dummy_fp8_linears found linears to quantize
            values = dummy_values(name, tuple(tensor.shape), device, generator)
            for key, value in dummy_fp8_state(module, values, config.fp8).items():
                tensors[key].data = value.to(_load_dtype(key, value, dtype))
            continue
        values = dummy_values(name, tuple(tensor.shape), device, generator)
        tensor.data = values.to(_load_dtype(name, tensor, dtype))  # fp8 experts (config.moe.fp8_experts) stay fp8
    logger.info("random (dummy) weights for %s, %d layers", config.architecture, config.num_layers)
    return model.eval()


def dummy_fp8_linears(model: HybridLM, config: ModelConfig) -> set[str]:
    """Turn the meta model's linears that the config's fp8 quantization_config declares into fp8 ones (the
    scale shapes its scheme stores) -> their names."""
    if config.fp8 is None:
        return set()
    fp8 = scheme_fp8_linears(config.fp8, linear_modules(model))
    to_fp8(model, scheme_layout(fp8, config.fp8))
    return fp8
