"""One rank's shard of a hybrid model: which heads / groups / rows it holds, the local ModelConfig (so the
mixers and the StateCache size themselves for the shard), the sharded HybridLM and its weights sliced from
the checkpoint (or from the same dummy values TP=1 draws).

Sharding (Megatron-style column then row parallel, one all-reduce per block):
  Mamba2: heads [r*H/TP, (r+1)*H/TP); B/C groups sharded when TP divides n_groups, otherwise each rank keeps
          the groups its heads read (one replicated group, or one copy per head when heads straddle groups);
          conv channels follow x/B/C; the gated RMSNorm keeps the global group size (models/parallel.py).
  Attention: query heads split evenly; KV heads split, or replicated (rank r keeps KV head r // (TP/Hkv))
          when TP > num_kv_heads.
  MLP: up_proj rows / down_proj columns. Embedding and lm_head: vocab rows (ceil(V/TP) each, zero padded).
  MoE: every routed expert's intermediate slice (up_proj [E, I/TP, D], down_proj [E, D, I/TP]; fp8 scale rows
          of up sliced alike, down's replicated), or with expert parallelism whole experts [E/TP, ...]; the shared
          expert like the MLP; router and latent projections replicated; down-projection biases on rank 0.
  MTP drafter (`mtp.layers.*`): its mixers like the trunk's; the fusion projection and norms replicated.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hybridserve.common.model_config import ModelConfig, MoEConfig
from hybridserve.kernels.ops import AUTO_KERNELS, Kernels
from hybridserve.models.fp8_dense import dummy_fp8_state, prepare_dense_state, scheme_layout, stored_layout, to_fp8
from hybridserve.models.fp8_weights import set_expert_precision
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.models.parallel import (
    ExpertParallelMoE,
    RowParallelLinear,
    ShardedGatedRMSNorm,
    TensorParallelMoE,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_shard,
)
from hybridserve.models.weights import (
    _EXPERT_KEY,
    _load_dtype,
    _normalize,
    checkpoint_files,
    dummy_fp8_linears,
    dummy_values,
    read_state_dict,
)

logger = logging.getLogger(__name__)

_LAYER_PARAM = re.compile(r"^(mtp\.)?layers\.(\d+)\.mixer\.(.+)$")
# row-parallel biases added after the all-reduce would count once per rank: rank 0 keeps them, the others zeros
_RANK0_BIASES = ("shared_experts.down_proj.bias", "fc2_latent_proj.bias")


@dataclass(frozen=True)
class MambaShard:
    """A rank's Mamba heads and the global B/C group behind each of its local groups."""

    head_start: int
    num_heads: int
    groups: tuple[int, ...]


def mamba_shards(config: ModelConfig, size: int) -> list[MambaShard]:
    """Every rank's Mamba shard; all ranks get the same local shapes (the state pools must agree)."""
    m = config.mamba
    assert m is not None
    if m.num_heads % size:
        raise ValueError(f"mamba heads ({m.num_heads}) must be divisible by tensor_parallel_size={size}")
    local = m.num_heads // size
    per_group = m.num_heads // m.n_groups
    head_groups = [[(r * local + j) // per_group for j in range(local)] for r in range(size)]
    distinct = [sorted(set(g)) for g in head_groups]
    uniform = all(len(d) == len(distinct[0]) and local % len(d) == 0 for d in distinct) and all(
        g == [d[j // (local // len(d))] for j in range(local)] for g, d in zip(head_groups, distinct)
    )
    return [
        MambaShard(r * local, local, tuple(distinct[r] if uniform else head_groups[r])) for r in range(size)
    ]


def attention_heads(config: ModelConfig, tp: TPGroup) -> tuple[int, int, list[int]]:
    """(first query head, query heads, global KV heads) of this rank."""
    a = config.attention
    assert a is not None
    if a.num_heads % tp.size:
        raise ValueError(f"attention heads ({a.num_heads}) must be divisible by tensor_parallel_size={tp.size}")
    q_local = a.num_heads // tp.size
    if a.num_kv_heads % tp.size == 0:
        kv_local = a.num_kv_heads // tp.size
        kv = list(range(tp.rank * kv_local, (tp.rank + 1) * kv_local))
    elif tp.size % a.num_kv_heads == 0:
        kv = [tp.rank // (tp.size // a.num_kv_heads)]  # replicated KV heads
    else:
        raise ValueError(f"num_key_value_heads ({a.num_kv_heads}) and tensor_parallel_size={tp.size} must divide "
                         "one another")
    return tp.rank * q_local, q_local, kv


def local_config(config: ModelConfig, tp: TPGroup) -> ModelConfig:
    """The ModelConfig of this rank's shard (vocab stays global: the vocab-parallel layers shard themselves)."""
    if tp.size == 1:
        return config
    changes: dict[str, object] = {}
    if config.moe is not None:
        changes["moe"] = local_moe(config.moe, tp)
    if config.mamba is not None:
        shard = mamba_shards(config, tp.size)[tp.rank]
        changes["mamba"] = dataclasses.replace(config.mamba, num_heads=shard.num_heads, n_groups=len(shard.groups))
    if config.attention is not None:
        _, q_local, kv = attention_heads(config, tp)
        changes["attention"] = dataclasses.replace(config.attention, num_heads=q_local, num_kv_heads=len(kv))
    if config.mlp_intermediate_size is not None:
        if config.mlp_intermediate_size % tp.size:
            raise ValueError(f"intermediate_size ({config.mlp_intermediate_size}) must be divisible by "
                             f"tensor_parallel_size={tp.size}")
        changes["mlp_intermediate_size"] = config.mlp_intermediate_size // tp.size
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def local_moe(moe: MoEConfig, tp: TPGroup) -> MoEConfig:
    """This rank's MoE shapes: every expert's intermediate slice, or (expert parallel) whole experts, E/size of
    them (the router keeps all E; the module cuts its expert tensors); the shared expert sliced either way."""
    checks = [("n_routed_experts", moe.num_experts) if tp.expert_parallel else
              ("moe_intermediate_size", moe.intermediate_size),
              ("moe_shared_expert_intermediate_size", moe.shared_intermediate_size)]
    for field, value in checks:
        if value % tp.size:
            raise ValueError(f"{field} ({value}) must be divisible by tensor_parallel_size={tp.size}")
    inner = moe.intermediate_size if tp.expert_parallel else moe.intermediate_size // tp.size
    return dataclasses.replace(moe, intermediate_size=inner, shared_intermediate_size=moe.shared_intermediate_size // tp.size)


def _span(start: int, count: int, unit: int = 1, base: int = 0) -> torch.Tensor:
    return torch.arange(base + start * unit, base + (start + count) * unit)


def shard_index(name: str, config: ModelConfig, tp: TPGroup) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) this rank keeps of the global tensor `name`; None: the whole tensor (replicated)."""
    if name in ("embeddings.weight", "lm_head.weight"):
        start, rows = vocab_shard(config.vocab_size, tp)
        return 0, torch.arange(start, start + rows)  # ids >= vocab_size are zero padding (see `shard_tensor`)
    match = _LAYER_PARAM.match(name)
    if match is None:
        return None
    kinds = config.mtp_layer_types if match[1] else config.layer_types
    kind, param = kinds[int(match[2])], match[3]
    if kind == "mamba":
        m = config.mamba
        assert m is not None
        s = mamba_shards(config, tp.size)[tp.rank]
        inner, gs = m.intermediate_size, m.n_groups * m.state_size
        heads_p = _span(s.head_start, s.num_heads, m.head_dim)
        b = torch.cat([_span(g, 1, m.state_size) for g in s.groups])
        conv = torch.cat([heads_p, inner + b, inner + gs + b])
        heads = _span(s.head_start, s.num_heads)
        table = {"in_proj": (0, torch.cat([heads_p, inner + conv, inner + m.conv_dim + heads])),
                 "conv1d": (0, conv), "norm": (0, heads_p), "out_proj.weight": (1, heads_p),
                 "dt_bias": (0, heads), "A_log": (0, heads), "D": (0, heads)}
    elif kind == "attention":
        a = config.attention
        assert a is not None
        q0, q_local, kv = attention_heads(config, tp)
        q = _span(q0, q_local, a.head_dim)
        kv_rows = torch.cat([_span(h, 1, a.head_dim) for h in kv])
        table = {"q_proj": (0, q), "k_proj": (0, kv_rows), "v_proj": (0, kv_rows), "o_proj.weight": (1, q)}
    elif kind == "mlp":
        assert config.mlp_intermediate_size is not None
        rows = config.mlp_intermediate_size // tp.size
        cut = _span(tp.rank, 1, rows)
        table = {"up_proj": (0, cut), "down_proj.weight": (1, cut)}
    elif kind == "moe":
        moe = config.moe
        assert moe is not None
        shared = _span(tp.rank, 1, moe.shared_intermediate_size // tp.size)
        if tp.expert_parallel:  # whole experts: rows of the stacked [E, ...] tensors
            experts = _span(tp.rank, 1, moe.num_experts // tp.size)
            up, down = (0, experts), (0, experts)
        else:
            cut = _span(tp.rank, 1, moe.intermediate_size // tp.size)
            up, down = (1, cut), (2, cut)
        table = {"experts.up_proj": up, "experts.down_proj": down,
                 "shared_experts.up_proj": (0, shared), "shared_experts.down_proj.weight": (1, shared),
                 "experts.up_proj_scale": up}  # fp8 [E, I] scales follow up's rows
        if tp.expert_parallel:  # fp8 [E, D] scales of down: per expert (TP: whole output rows, replicated)
            table["experts.down_proj_scale"] = down
    else:
        raise ValueError(f"layers of type {kind!r} have no tensor-parallel sharding")
    for key, value in table.items():
        if param == key or param.startswith(key + "."):
            return value
    return None  # row-parallel biases, replicated


def shard_tensor(name: str, full: torch.Tensor, config: ModelConfig, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of the global tensor `name` (vocab rows past the end are zeros)."""
    if tp.size == 1:
        return full
    if tp.rank and name.endswith(_RANK0_BIASES):
        return torch.zeros_like(full)
    if name.endswith((".weight_scale", ".input_scale")) and full.numel() == 1:
        return full  # per-tensor fp8 scales: every rank's slice has the same one
    plan = shard_index(name, config, tp)
    if plan is None:
        return full
    dim, index = plan
    keep = index < full.shape[dim]
    out = full.index_select(dim, index[keep].to(full.device))
    if not bool(keep.all()):
        pad = list(out.shape)
        pad[dim] = int((~keep).sum())
        out = torch.cat([out, out.new_zeros(pad)], dim=dim)
    return out


def sharded_model(config: ModelConfig, tp: TPGroup, kernels: Kernels = AUTO_KERNELS) -> HybridLM:
    """The HybridLM of this rank's shard on the meta device (local shapes, TP layers swapped in)."""
    local = local_config(config, tp)
    with torch.device("meta"):
        model = HybridLM(local, kernels)
        if tp.size == 1:
            return model
        model.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)  # type: ignore[assignment]
        model.lm_head = VocabParallelLMHead(config.hidden_size, config.vocab_size, tp, kernels)
        blocks = [*model.layers, *(model.mtp.layers if model.mtp is not None else [])]
        for block in blocks:
            _swap_row_parallel(block, config, local, tp, kernels)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def expert_held(index: int, config: ModelConfig, tp: TPGroup) -> bool:
    """Whether this rank holds (a slice of) routed expert `index`."""
    if not tp.expert_parallel:
        return True
    assert config.moe is not None
    per_rank = config.moe.num_experts // tp.size
    return tp.rank * per_rank <= index < (tp.rank + 1) * per_rank


def has_mtp_weights(model_dir: str | Path) -> bool:
    """Whether the checkpoint ships `mtp.*` tensors (reads the safetensors headers only)."""
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            if any(_normalize(name).startswith("mtp.") for name in handle.keys()):
                return True
    return False


def _swap_row_parallel(block: Any, config: ModelConfig, local: ModelConfig, tp: TPGroup, kernels: Kernels) -> None:
    """Give a trunk block or MTP layer of the meta model its row-parallel output (the block's all-reduce)."""
    mixer: Any = block.mixer  # the layer kind below says which module it is
    if block.kind == "mamba":
        assert config.mamba is not None and local.mamba is not None
        inner = local.mamba.intermediate_size
        shard = mamba_shards(config, tp.size)[tp.rank]
        mixer.out_proj = RowParallelLinear(inner, config.hidden_size, config.mamba.proj_bias, tp, kernels)
        mixer.norm = ShardedGatedRMSNorm(inner, shard.head_start * config.mamba.head_dim,
                                         config.mamba.intermediate_size // config.mamba.n_groups,
                                         config.mamba.n_groups, config.norm_eps, tp, kernels)
    elif block.kind == "attention":
        assert local.attention is not None
        width = local.attention.num_heads * local.attention.head_dim
        mixer.o_proj = RowParallelLinear(width, config.hidden_size, local.attention.bias, tp, kernels)
    elif block.kind == "mlp":
        assert local.mlp_intermediate_size is not None
        mixer.down_proj = RowParallelLinear(local.mlp_intermediate_size, config.hidden_size, config.mlp_bias, tp,
                                            kernels)
    else:
        assert local.moe is not None
        assert config.moe is not None
        block.mixer = (ExpertParallelMoE(config.hidden_size, config.moe, config.mlp_bias, tp, kernels)
                       if tp.expert_parallel else TensorParallelMoE(config.hidden_size, local.moe, config.mlp_bias, tp,
                                                                    kernels))


def _fill(model: HybridLM, values: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> HybridLM:
    expected = dict([*model.named_parameters(), *model.named_buffers()])
    missing = sorted(set(expected) - set(values))
    if missing:
        raise ValueError(f"the checkpoint lacks tensors the config needs: {missing[:8]}")
    model = model.to_empty(device=device)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tuple(values[name].shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name}: shard shape {tuple(values[name].shape)}, model {tuple(tensor.shape)}")
        tensor.data = values[name].to(device=device, dtype=_load_dtype(name, values[name], dtype))
    return model.eval()


def load_shard(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               tp: TPGroup, kernels: Kernels = AUTO_KERNELS) -> HybridLM:
    """This rank's shard filled from a safetensors checkpoint, one global tensor in memory at a time
    (per-expert tensors, as published MoE checkpoints store them, sliced one expert at a time and stacked)."""
    if stores_fp8(model_dir):
        return _load_fp8_shard(Path(model_dir), config, dtype, device, tp, kernels)
    model = sharded_model(config, tp, kernels)
    wanted = set(dict([*model.named_parameters(), *model.named_buffers()]))
    values: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            for raw in handle.keys():
                name = _normalize(raw)
                expert = _EXPERT_KEY.match(name)
                if expert is not None and expert[4] != "input_scale":
                    stacked, index = f"{expert[1]}.{expert[3]}", int(expert[2])
                    if stacked in wanted and expert_held(index, config, tp):  # stacked to [E, ...] below
                        one = handle.get_tensor(raw)[None]  # [1, I, D] / [1, D, I]: whole, or this rank's slice
                        experts.setdefault(stacked, {})[index] = one[0] if tp.expert_parallel else shard_tensor(
                            stacked, one, config, tp)[0]
                elif name in wanted:
                    values[name] = shard_tensor(name, handle.get_tensor(raw), config, tp)
    values.update({name: torch.stack([per[i] for i in sorted(per)]) for name, per in experts.items()})
    if "lm_head.weight" not in values and config.tie_word_embeddings and "embeddings.weight" in values:
        values["lm_head.weight"] = values["embeddings.weight"]
    logger.info("rank %d/%d: loaded its shard of %s", tp.rank, tp.size, model_dir)
    return _fill(model, values, dtype, device)


def stores_fp8(model_dir: str | Path) -> bool:
    """Whether the checkpoint stores fp8 weights (`*.weight_scale` tensors; reads the safetensors headers only)."""
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            if any(name.endswith(".weight_scale") for name in handle.keys()):
                return True
    return False


def _load_fp8_shard(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                    tp: TPGroup, kernels: Kernels) -> HybridLM:
    """An fp8 checkpoint's shard: read whole as `weights.load_model` reads it (dense fp8 linears and routed
    experts, stacked, kept fp8), then sliced (per-channel scales with their rows, per-tensor ones replicated).
    Holds the checkpoint in host memory once per rank, unlike the streaming bf16 path."""
    state = read_state_dict(model_dir)
    if config.moe is not None:
        fp8 = set_expert_precision(state, None)
        config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, fp8_experts=fp8))
    if "lm_head.weight" not in state and config.tie_word_embeddings and "embeddings.weight" in state:
        state["lm_head.weight"] = state["embeddings.weight"]
    model = sharded_model(config, tp, kernels)
    to_fp8(model, stored_layout(prepare_dense_state(state, model), state))
    wanted = dict([*model.named_parameters(), *model.named_buffers()])
    values = {name: shard_tensor(name, state[name], config, tp) for name in wanted if name in state}
    logger.info("rank %d/%d: loaded its shard of the fp8 checkpoint %s", tp.rank, tp.size, model_dir)
    return _fill(model, values, dtype, device)


def dummy_shard(config: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup,
                seed: int = 0, kernels: Kernels = AUTO_KERNELS) -> HybridLM:
    """This rank's slice of the very weights `weights.dummy_model(config, ...)` draws (same generator order)."""
    model = sharded_model(config, tp, kernels)
    with torch.device("meta"):
        full = HybridLM(config)
    fp8 = dummy_fp8_linears(full, config)
    if config.fp8 is not None:
        to_fp8(model, scheme_layout(fp8, config.fp8))
    generator = torch.Generator(device=device).manual_seed(seed)
    values: dict[str, torch.Tensor] = {}
    for name, t in [*full.named_parameters(), *full.named_buffers()]:
        module, _, leaf = name.rpartition(".")
        if module in fp8 and leaf in ("weight_scale", "input_scale"):
            continue  # made with the weight
        drawn = dummy_values(name, tuple(t.shape), device, generator)
        if module in fp8 and leaf == "weight" and config.fp8 is not None:
            values.update(dummy_fp8_state(module, drawn, config.fp8))  # quantized whole, as at TP=1
        else:
            values[name] = drawn
    return _fill(model, {name: shard_tensor(name, v, config, tp) for name, v in values.items()}, dtype, device)
