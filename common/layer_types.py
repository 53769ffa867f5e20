"""The layer lists of a NemotronH `config.json`: the trunk's (`layers_block_type` in current or legacy names, or
the `hybrid_override_pattern` string) and the MTP module's (`num_nextn_predict_layers` x `mtp_layers_block_type`)."""

from __future__ import annotations

from typing import Any

LAYER_KINDS = ("mamba", "attention", "mlp", "moe")

# names used by transformers (current and legacy) and by the `hybrid_override_pattern` string
_LAYER_ALIASES = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "M": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "*": "attention",
    "mlp": "mlp",
    "-": "mlp",
    "moe": "moe",
    "E": "moe",
}


def parse_layer_types(data: dict[str, Any]) -> tuple[str, ...]:
    listed = data.get("layers_block_type") or data.get("layer_types")
    pattern = data.get("hybrid_override_pattern")
    if listed is not None:
        raw = list(listed)
        field_name = "layers_block_type"
    elif pattern is not None:
        raw = list(str(pattern))
        field_name = "hybrid_override_pattern"
    else:
        raise ValueError("nemotron_h config needs `layers_block_type` or `hybrid_override_pattern`")
    unknown = sorted({t for t in raw if t not in _LAYER_ALIASES})
    if unknown:
        raise ValueError(
            f"config field `{field_name}` has unknown layer types {unknown}; "
            "expected M/*/-/E or mamba/attention/mlp/moe"
        )
    types = tuple(_LAYER_ALIASES[t] for t in raw)
    declared = data.get("num_hidden_layers")
    if field_name == "hybrid_override_pattern" and declared is not None and declared != len(types):
        raise ValueError(
            f"config field `num_hidden_layers` ({declared}) does not match the length of "
            f"`hybrid_override_pattern` ({len(types)})"
        )
    return types


def parse_mtp_layer_types(data: dict[str, Any]) -> tuple[str, ...]:
    """The MTP module's layer list (`num_nextn_predict_layers` steps of `mtp_layers_block_type`)."""
    steps = data.get("num_nextn_predict_layers") or 0
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"config field `num_nextn_predict_layers` must be a non-negative integer, got {steps!r}")
    if steps == 0:
        return ()
    if steps > 1:
        raise ValueError(f"config field `num_nextn_predict_layers` is {steps}; only one MTP step is supported")
    listed = data.get("mtp_layers_block_type")
    raw = list(listed) if listed is not None else list(str(data.get("mtp_hybrid_override_pattern") or "*E"))
    unknown = sorted({str(t) for t in raw if t not in _LAYER_ALIASES})
    if unknown or not raw:
        raise ValueError(f"config field `mtp_layers_block_type` has unknown or no layer types: {unknown or raw}")
    return tuple(_LAYER_ALIASES[t] for t in raw)
