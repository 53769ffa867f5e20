"""Model configuration read from a transformers `config.json`, validated on construction.

One frozen `ModelConfig` describes both supported families: `nemotron_h` (hybrid Mamba2 / attention /
MLP / MoE blocks) and `mamba2` (Mamba2 blocks only). Errors name the offending field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridserve.common.fp8_scheme import Fp8Scheme, parse_fp8_scheme
from hybridserve.common.layer_types import LAYER_KINDS, parse_layer_types, parse_mtp_layer_types

DEFAULT_MAX_MODEL_LEN = 8192  # context limit of models that declare no positional limit (Mamba2)

KV_CACHE_DTYPES = ("auto", "fp8")
SSM_CACHE_DTYPES = ("float32", "bfloat16", "float16")
ARCHITECTURES = {"NemotronHForCausalLM": "nemotron_h", "Mamba2ForCausalLM": "mamba2"}


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"config field `{name}` must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class MambaConfig:
    """Shapes and constants of the Mamba2 mixers."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float]
    activation: str = "silu"

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"):
            _positive(name, getattr(self, name))
        if self.num_heads % self.n_groups != 0:
            raise ValueError(
                f"config field `n_groups` ({self.n_groups}) must divide the mamba head count ({self.num_heads})"
            )
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"config field `mamba_hidden_act` must be 'silu', got {self.activation!r}")
        low, high = self.dt_limit
        if not 0.0 <= low <= high:
            raise ValueError(f"config field `time_step_limit` must satisfy 0 <= min <= max, got {self.dt_limit}")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        """in_proj output: z, xBC, dt."""
        return self.intermediate_size + self.conv_dim + self.num_heads


@dataclass(frozen=True)
class AttentionConfig:
    """GQA attention without positional embedding (NemotronH)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            _positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"config field `num_key_value_heads` ({self.num_kv_heads}) must divide "
                f"`num_attention_heads` ({self.num_heads})"
            )


@dataclass(frozen=True)
class MoEConfig:
    """NemotronH mixture of non-gated relu2 experts with a sigmoid group-limited top-k router."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    shared_intermediate_size: int
    latent_size: int | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # routed expert weights held as float8_e4m3fn with per-output-channel fp32 scales: config.json's
    # `quantization_config` says FP8 (dummy weights follow it); the loader sets it from the tensors it finds
    fp8_experts: bool = False
    # with fp8_experts: the grouped expert GEMMs quantize their inputs to fp8 per row and multiply fp8 x fp8 (W8A8,
    # as vLLM runs fp8 MoE checkpoints); a runtime choice (EngineConfig.moe_fp8_activations)
    fp8_activations: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "experts_per_token", "intermediate_size", "n_group", "topk_group"):
            _positive(name, getattr(self, name))
        if self.experts_per_token > self.num_experts:
            raise ValueError("config field `num_experts_per_tok` exceeds `n_routed_experts`")
        if self.num_experts % self.n_group != 0 or self.topk_group > self.n_group:
            raise ValueError("config fields `n_group` / `topk_group` do not fit `n_routed_experts`")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about a checkpoint."""

    architecture: str  # "nemotron_h" | "mamba2"
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    norm_eps: float
    tie_word_embeddings: bool
    residual_in_fp32: bool
    mamba: MambaConfig | None
    attention: AttentionConfig | None = None
    mlp_intermediate_size: int | None = None
    mlp_bias: bool = False
    mlp_activation: str = "relu2"
    moe: MoEConfig | None = None
    max_position_embeddings: int | None = None
    ssm_state_dtype: str = "float32"
    # attention KV pages: "auto" (the model dtype) or "fp8" (float8_e4m3fn, scaled per layer as vLLM's fp8 KV)
    kv_cache_dtype: str = "auto"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # the multi-token-prediction (MTP) drafter's layers, in order; () when the checkpoint has no MTP module
    mtp_layer_types: tuple[str, ...] = ()
    # fp8 weights as `quantization_config` declares them (dummy weights follow it; a load follows the tensors)
    fp8: Fp8Scheme | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise ValueError(f"unknown architecture {self.architecture!r}")
        _positive("vocab_size", self.vocab_size)
        _positive("hidden_size", self.hidden_size)
        if not self.layer_types:
            raise ValueError("config field `layers_block_type` is empty: the model has no layers")
        bad = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if bad:
            raise ValueError(f"config field `layers_block_type` has unknown layer types {bad}")
        needs = {"mamba": self.mamba, "attention": self.attention, "mlp": self.mlp_intermediate_size, "moe": self.moe}
        for kind, part in needs.items():
            if (kind in self.layer_types or kind in self.mtp_layer_types) and part is None:
                raise ValueError(f"layers of type {kind!r} are present but their config fields are missing")
        if "mamba" in self.mtp_layer_types:
            raise ValueError("config field `mtp_layers_block_type`: Mamba layers in the MTP module are not supported")
        if ("mlp" in self.layer_types or "moe" in self.layer_types) and self.mlp_activation != "relu2":
            raise ValueError(f"config field `mlp_hidden_act` must be 'relu2', got {self.mlp_activation!r}")
        if self.ssm_state_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"config field `mamba_ssm_cache_dtype` must be float32, bfloat16 or float16, got {self.ssm_state_dtype!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"config field `layer_norm_epsilon` must be > 0, got {self.norm_eps}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def layers_of(self, kind: str) -> list[int]:
        """Indices of the layers of one kind."""
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    @property
    def has_mtp(self) -> bool:
        return bool(self.mtp_layer_types)

    def kv_layers(self) -> list[int]:
        """Layers with a KV cache: the attention layers, then the MTP module's (numbered num_layers + i)."""
        mtp = [self.num_layers + i for i, t in enumerate(self.mtp_layer_types) if t == "attention"]
        return self.layers_of("attention") + mtp

    @property
    def pattern(self) -> str:
        """The layer list as a `hybrid_override_pattern` string."""
        return "".join({"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}[t] for t in self.layer_types)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} is not a model directory: no config.json in it")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(data)

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from the dict transformers writes as config.json."""
        arch = _architecture(data)
        if arch == "nemotron_h":
            return _nemotron_h(data)
        return _mamba2(data)


def _architecture(data: dict[str, Any]) -> str:
    archs = data.get("architectures") or []
    for name in archs:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = data.get("model_type")
    if model_type in ARCHITECTURES.values():
        return str(model_type)
    raise ValueError(
        f"unsupported model: config field `architectures` is {archs!r} and `model_type` is {model_type!r}; "
        f"supported: {sorted(ARCHITECTURES)} (model_type {sorted(ARCHITECTURES.values())})"
    )


def _eos_ids(data: dict[str, Any]) -> tuple[int, ...]:
    eos = data.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _json_float(value: Any, field_name: str) -> float:
    """A float as config.json may spell it: a number, "Infinity", or transformers' {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config field `{field_name}` holds {value!r}, not a number") from exc


def _dt_limit(value: Any) -> tuple[float, float]:
    if value is None:
        return (0.0, math.inf)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"config field `time_step_limit` must be a pair [min, max], got {value!r}")
    return (_json_float(value[0], "time_step_limit"), _json_float(value[1], "time_step_limit"))


def _nemotron_h(data: dict[str, Any]) -> ModelConfig:
    trunk_types = parse_layer_types(data)
    mtp_types = parse_mtp_layer_types(data)
    types = trunk_types + mtp_types  # which layer configs to build
    hidden = int(data.get("hidden_size", 4096))
    mamba = None
    if "mamba" in types:
        # transformers' NemotronH clamps dt to [time_step_min, inf) and ignores `time_step_limit`;
        # we follow it, because transformers is the numerical oracle for this architecture.
        mamba = MambaConfig(
            num_heads=int(data.get("mamba_num_heads", 128)),
            head_dim=int(data.get("mamba_head_dim", 64)),
            state_size=int(data.get("ssm_state_size", 128)),
            n_groups=int(data.get("n_groups", data.get("mamba_n_groups", 8))),
            conv_kernel=int(data.get("conv_kernel", data.get("mamba_d_conv", 4))),
            chunk_size=int(data.get("chunk_size", data.get("mamba_chunk_size", 128))),
            use_conv_bias=bool(data.get("use_conv_bias", data.get("mamba_conv_bias", True))),
            proj_bias=bool(data.get("use_bias", data.get("mamba_proj_bias", False))),
            dt_limit=(float(data.get("time_step_min", data.get("mamba_dt_min", 0.001))), math.inf),
            activation=str(data.get("mamba_hidden_act", "silu")),
        )
    attention = None
    if "attention" in types:
        heads = int(data.get("num_attention_heads", 32))
        attention = AttentionConfig(
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            bias=bool(data.get("attention_bias", False)),
        )
    moe = None
    if "moe" in types:
        moe = MoEConfig(
            num_experts=int(data.get("n_routed_experts", 8)),
            experts_per_token=int(data.get("num_experts_per_tok", 2)),
            intermediate_size=int(data.get("moe_intermediate_size", 7688)),
            shared_intermediate_size=int(data.get("moe_shared_expert_intermediate_size", 7688)),
            latent_size=data.get("moe_latent_size"),
            n_group=int(data.get("n_group", 1)),
            topk_group=int(data.get("topk_group", 1)),
            norm_topk_prob=bool(data.get("norm_topk_prob", True)),
            routed_scaling_factor=float(data.get("routed_scaling_factor", 1.0)),
            fp8_experts=parse_fp8_scheme(data) is not None,
        )
    return ModelConfig(
        architecture="nemotron_h",
        vocab_size=int(data.get("vocab_size", 131072)),
        hidden_size=hidden,
        layer_types=trunk_types,
        mtp_layer_types=mtp_types,
        norm_eps=float(data.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        residual_in_fp32=bool(data.get("residual_in_fp32", False)),
        mamba=mamba,
        attention=attention,
        mlp_intermediate_size=int(data.get("intermediate_size", 21504)) if "mlp" in types else None,
        mlp_bias=bool(data.get("mlp_bias", False)),
        mlp_activation=str(data.get("mlp_hidden_act", "relu2")),
        moe=moe,
        max_position_embeddings=data.get("max_position_embeddings"),
        ssm_state_dtype=str(data.get("mamba_ssm_cache_dtype", "float32")),
        eos_token_ids=_eos_ids(data),
        bos_token_id=data.get("bos_token_id"),
        pad_token_id=data.get("pad_token_id"),
        fp8=parse_fp8_scheme(data),
        raw=dict(data),
    )


def _mamba2(data: dict[str, Any]) -> ModelConfig:
    hidden = int(data.get("hidden_size", 4096))
    heads = int(data.get("num_heads", 128))
    head_dim = int(data.get("head_dim", 64))
    expand = data.get("expand", 2)
    if int(expand * hidden) != heads * head_dim:
        raise ValueError(
            f"inconsistent mamba2 config: `hidden_size` * `expand` ({int(expand * hidden)}) must equal "
            f"`num_heads` * `head_dim` ({heads * head_dim})"
        )
    num_layers = int(data.get("num_hidden_layers", 64))
    mamba = MambaConfig(
        num_heads=heads,
        head_dim=head_dim,
        state_size=int(data.get("state_size", 128)),
        n_groups=int(data.get("n_groups", 8)),
        conv_kernel=int(data.get("conv_kernel", 4)),
        chunk_size=int(data.get("chunk_size", 256)),
        use_conv_bias=bool(data.get("use_conv_bias", True)),
        proj_bias=bool(data.get("use_bias", False)),
        dt_limit=_dt_limit(data.get("time_step_limit")),
        activation=str(data.get("hidden_act", "silu")),
    )
    return ModelConfig(
        architecture="mamba2",
        vocab_size=int(data.get("vocab_size", 32768)),
        hidden_size=hidden,
        layer_types=("mamba",) * num_layers,
        norm_eps=float(data.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        residual_in_fp32=bool(data.get("residual_in_fp32", True)),
        mamba=mamba,
        max_position_embeddings=data.get("max_position_embeddings"),
        ssm_state_dtype=str(data.get("mamba_ssm_cache_dtype", "float32")),
        eos_token_ids=_eos_ids(data),
        bos_token_id=data.get("bos_token_id"),
        pad_token_id=data.get("pad_token_id"),
        fp8=parse_fp8_scheme(data),
        raw=dict(data),
    )
