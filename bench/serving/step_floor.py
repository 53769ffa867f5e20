"""The bytes floor of one decode step of a served model: the fewest bytes the step must move through GPU memory,
over the measured copy bandwidth.

A decode step at batch B reads every dense weight once (attention, Mamba projections, shared experts, lm_head),
the routed experts that B x top-k tokens touch (uniform routing: E * (1 - (1 - k/E)^B) of E experts, what random
weights give; a real checkpoint can route less evenly), B embedding rows, each sequence's SSM and conv state once
read and once written, its attention KV up to its context once read and the new token's once written, and the
logits once written and once read by the sampler. Activations between layers stay out (a few MB at B = 1,024).
Weight sizes come from the model built on the meta device, so fp8 layers count as one byte per weight.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "auto": 2}
LOGIT_BYTES = 4  # the lm_head's fp32 logits [B, vocab]


@dataclass(frozen=True)
class ModelBytes:
    """What one decode step of a model touches, before the batch is known."""

    dense: int  # weight bytes read whole every step (all but the embedding table and routed experts)
    routed_experts: int  # stacked routed expert weights (+ their scales)
    embedding_row: int  # bytes of one embedding row (an input token's lookup)
    num_experts: int  # routed experts (0: no MoE)
    experts_per_token: int
    ssm_state: int  # SSM state elements of one sequence, all Mamba layers ([H, P, N] each)
    conv_state: int  # conv state elements of one sequence, all Mamba layers ([conv_dim, K - 1] each)
    kv_token: int  # K + V elements of one token, all attention layers
    vocab: int

    @property
    def weights(self) -> int:
        """Every weight byte but the embedding table: what a step reads when all experts are touched."""
        return self.dense + self.routed_experts


def model_bytes(config_json: dict[str, Any], dtype: str = "bfloat16") -> ModelBytes:
    """`ModelBytes` of a transformers config.json, from the model built on the meta device in `dtype` (fp8 routed
    experts, and fp8 linears where the config's quantization_config asks for them, count one byte per weight)."""
    import torch

    from hybridserve.common.model_config import ModelConfig
    from hybridserve.models.hybrid_model import HybridLM
    from hybridserve.models.weights import dummy_fp8_linears

    config = ModelConfig.from_hf_dict(config_json)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device("meta"):
            model = HybridLM(config)
            dummy_fp8_linears(model, config)  # the linears `--load-format dummy` makes fp8 (none without fp8)
    finally:
        torch.set_default_dtype(previous)
    dense = routed = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        size = t.numel() * t.element_size()
        if name.startswith("mtp."):
            continue  # the drafter runs only with speculative decoding
        if ".experts." in name:
            routed += size
        elif name == "embeddings.weight" and not config.tie_word_embeddings:
            continue  # B rows of it, counted per step
        else:
            dense += size
    embed = model.embeddings.weight
    n_mamba = config.layer_types.count("mamba")
    n_attn = config.layer_types.count("attention")
    m, a = config.mamba, config.attention
    return ModelBytes(
        dense=dense, routed_experts=routed, embedding_row=embed.shape[1] * embed.element_size(),
        num_experts=config.moe.num_experts if config.moe else 0,
        experts_per_token=config.moe.experts_per_token if config.moe else 0,
        ssm_state=n_mamba * m.num_heads * m.head_dim * m.state_size if m else 0,
        conv_state=n_mamba * m.conv_dim * (m.conv_kernel - 1) if m else 0,
        kv_token=n_attn * 2 * a.num_kv_heads * a.head_dim if a else 0,
        vocab=config.vocab_size,
    )


def experts_touched(num_experts: int, experts_per_token: int, batch: int) -> float:
    """Expected distinct experts that `batch` tokens choose under uniform top-k routing."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** batch)


def step_bytes(mb: ModelBytes, batch: int, context: int, ssm_dtype: str = "float32", kv_dtype: str = "bfloat16",
               conv_dtype: str = "bfloat16") -> dict[str, float]:
    """Bytes of one decode step at `batch` sequences of `context` cached tokens each, by part, and their total."""
    if batch <= 0 or context < 0:
        raise ValueError(f"batch must be > 0 and context >= 0, got batch={batch}, context={context}")
    share = experts_touched(mb.num_experts, mb.experts_per_token, batch) / mb.num_experts if mb.num_experts else 0.0
    parts = {
        "weights": mb.dense + share * mb.routed_experts + batch * mb.embedding_row,
        "ssm_state": 2.0 * batch * mb.ssm_state * DTYPE_BYTES[ssm_dtype],
        "conv_state": 2.0 * batch * mb.conv_state * DTYPE_BYTES[conv_dtype],
        "kv": float(batch * (context + 1) * mb.kv_token * DTYPE_BYTES[kv_dtype]),
        "logits": 2.0 * batch * mb.vocab * LOGIT_BYTES,
    }
    parts["total"] = sum(parts.values())
    return parts


def floor_ms(nbytes: float, copy_gbps: float) -> float:
    """Milliseconds to move `nbytes` at `copy_gbps` (GB/s counting bytes read plus bytes written)."""
    if copy_gbps <= 0:
        raise ValueError(f"copy bandwidth must be > 0 GB/s, got {copy_gbps}")
    return nbytes / copy_gbps / 1e6


def recipe_fp8_exclusions(config_json: dict[str, Any]) -> list[str]:
    """Modules NVIDIA's Nemotron 3 Nano FP8 checkpoint keeps in bf16 (its selective recipe: lm_head, every
    attention layer and the Mamba layer feeding each), as ModelOpt `exclude_modules` patterns."""
    pattern = str(config_json.get("hybrid_override_pattern", ""))
    kept = {j for i, kind in enumerate(pattern) if kind == "*" for j in (i - 1, i) if j >= 0 and pattern[j] in "M*"}
    return ["lm_head", *(f"backbone.layers.{i}.mixer*" for i in sorted(kept))]


def with_fp8_quantization(config_json: dict[str, Any]) -> dict[str, Any]:
    """A copy of config.json declaring ModelOpt FP8 weights with the recipe's bf16 layers (what `--load-format
    dummy` turns into fp8 experts and fp8 dense linears)."""
    out = dict(config_json)
    out["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8",
                                  "exclude_modules": recipe_fp8_exclusions(config_json)}
    return out


def describe(mb: ModelBytes) -> dict[str, Any]:
    """`ModelBytes` as JSON with the weight total in GB, for result files."""
    return {**dataclasses.asdict(mb), "weights_GB": mb.weights / 1e9}
