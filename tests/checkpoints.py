"""Tiny random checkpoints written by transformers' own `save_pretrained`, and transformers' outputs on
them: the numerical oracle of the test suite."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, NemotronHConfig, NemotronHForCausalLM

BASE_NEMOTRON_H = dict(
    vocab_size=128,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=16,
    ssm_state_size=8,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
)

BASE_MAMBA2 = dict(
    vocab_size=128,
    hidden_size=32,
    num_heads=4,
    head_dim=16,
    expand=2,
    state_size=8,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,
    num_hidden_layers=3,
    eos_token_id=2,
    bos_token_id=0,
    pad_token_id=1,
)


def _save(model: torch.nn.Module) -> Path:
    directory = Path(tempfile.mkdtemp(prefix="hybridserve-ckpt-"))
    model.save_pretrained(str(directory))
    return directory


@functools.cache
def nemotron_h(pattern: str = "M*-M", seed: int = 0, **overrides: object) -> tuple[Path, NemotronHForCausalLM]:
    """(checkpoint dir, the transformers model it was written from) for a NemotronH layer pattern."""
    torch.manual_seed(seed)
    config = NemotronHConfig(**{**BASE_NEMOTRON_H, "hybrid_override_pattern": pattern, **overrides})
    model = NemotronHForCausalLM(config).eval()
    return _save(model), model


# a Nemotron-3-like MoE block in miniature: 8 routed experts (top-3) in 2 groups, a shared expert, the correction
# bias and scaling factor of the published configs
MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=32,  # 2 x 16: the fused path runs it as two extra experts, as for Nano
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
)


@functools.cache
def nemotron_h_moe(pattern: str = "ME*E", seed: int = 0, **overrides: object) -> tuple[Path, NemotronHForCausalLM]:
    """A NemotronH MoE checkpoint whose router and experts matter: transformers initialises the correction bias
    to zeros and the experts at std 0.02, so both are redrawn (bias N(0, 0.5), experts at unit gain)."""
    torch.manual_seed(seed)
    config = NemotronHConfig(**{**BASE_NEMOTRON_H, **MOE, "hybrid_override_pattern": pattern, **overrides})
    model = NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if ".experts.up_proj" in name or ".experts.down_proj" in name:
                tensor.normal_(0, tensor.shape[-1] ** -0.5)
            elif name.endswith("gate.weight"):
                tensor.normal_(0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.5)
    return _save(model), model


@functools.cache
def mamba2(seed: int = 0, **overrides: object) -> tuple[Path, Mamba2ForCausalLM]:
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(Mamba2Config(**{**BASE_MAMBA2, **overrides})).eval()
    return _save(model), model


@torch.no_grad()
def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' full-sequence forward: logits [L, vocab]."""
    return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, token_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by re-running transformers' full forward on the growing sequence."""
    tokens = list(token_ids)
    for _ in range(max_tokens):
        tokens.append(int(hf_logits(model, tokens)[-1].argmax()))
    return tokens[len(token_ids) :]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


@functools.cache
def nemotron_h_mtp(
    pattern: str = "M*-M", mtp_types: tuple[str, ...] = ("attention", "mlp"), seed: int = 0, moe: bool = False,
) -> tuple[Path, NemotronHForCausalLM]:
    """A NemotronH checkpoint plus a random MTP module (`mtp.layers.*`, vLLM's nemotron_h_mtp layout); with
    moe=True the trunk is `nemotron_h_moe` and MoE layers in the MTP module take its MOE shapes."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source, model = nemotron_h_moe(pattern, seed) if moe else nemotron_h(pattern, seed)
    directory = Path(tempfile.mkdtemp(prefix="hybridserve-mtp-"))
    shutil.copytree(source, directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    config.update(num_nextn_predict_layers=1, mtp_layers_block_type=list(mtp_types))
    (directory / "config.json").write_text(json.dumps(config))
    hidden, inter = BASE_NEMOTRON_H["hidden_size"], BASE_NEMOTRON_H["intermediate_size"]
    heads, kv_heads, head_dim = 4, 2, 8
    generator = torch.Generator().manual_seed(seed + 1000)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    tensors = load_file(str(directory / "model.safetensors"))
    tensors["mtp.layers.0.enorm.weight"] = 1.0 + rand(hidden, scale=0.1)
    tensors["mtp.layers.0.hnorm.weight"] = 1.0 + rand(hidden, scale=0.1)
    tensors["mtp.layers.0.eh_proj.weight"] = rand(hidden, 2 * hidden)
    for i, kind in enumerate(mtp_types):
        prefix = f"mtp.layers.{i}"
        tensors[f"{prefix}.norm.weight"] = 1.0 + rand(hidden, scale=0.1)
        if kind == "attention":
            tensors[f"{prefix}.mixer.q_proj.weight"] = rand(heads * head_dim, hidden)
            tensors[f"{prefix}.mixer.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
            tensors[f"{prefix}.mixer.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
            tensors[f"{prefix}.mixer.o_proj.weight"] = rand(hidden, heads * head_dim)
        elif kind == "moe":
            experts, moe_inter = MOE["n_routed_experts"], MOE["moe_intermediate_size"]
            shared = MOE["moe_shared_expert_intermediate_size"]
            tensors[f"{prefix}.mixer.gate.weight"] = rand(experts, hidden, scale=0.3)
            tensors[f"{prefix}.mixer.gate.e_score_correction_bias"] = rand(experts, scale=0.5)
            for e in range(experts):  # per-expert tensors, as published checkpoints store them
                tensors[f"{prefix}.mixer.experts.{e}.up_proj.weight"] = rand(moe_inter, hidden, scale=hidden**-0.5)
                tensors[f"{prefix}.mixer.experts.{e}.down_proj.weight"] = rand(hidden, moe_inter, scale=moe_inter**-0.5)
            tensors[f"{prefix}.mixer.shared_experts.up_proj.weight"] = rand(shared, hidden)
            tensors[f"{prefix}.mixer.shared_experts.down_proj.weight"] = rand(hidden, shared)
        else:
            tensors[f"{prefix}.mixer.up_proj.weight"] = rand(inter, hidden)
            tensors[f"{prefix}.mixer.down_proj.weight"] = rand(hidden, inter)
    tensors[f"mtp.layers.{len(mtp_types) - 1}.final_layernorm.weight"] = 1.0 + rand(hidden, scale=0.1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory, model
