"""Sampling defaults a checkpoint ships in its `generation_config.json`, applied to what a request leaves unset.

vLLM does the same by default (`--generation-config auto`): a model's authors know which temperature or
repetition penalty it needs, and a client that does not say otherwise gets those. Only the sampling fields are
taken (temperature, top_p, top_k, repetition_penalty, no_repeat_ngram_size, and max_new_tokens as the default
max_tokens); everything
else in the file (token ids, `do_sample`, beam settings) is transformers' business and ignored. A value a
client sends always wins. Torch-free: the router imports it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridserve.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM takes the same keys; we have no min_p)
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
                 "no_repeat_ngram_size": "no_repeat_ngram_size"}  # the last: transformers' key, beyond vLLM's
NO_DEFAULTS = ("none", "vllm")  # ignore the checkpoint's file (vLLM spells it "vllm")


@dataclass(frozen=True)
class GenerationDefaults:
    """SamplingParams field -> default, and the file it came from ("" when none)."""

    values: tuple[tuple[str, Any], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        fields = dict(self.values)
        unknown = set(fields) - set(SAMPLING_KEYS.values())
        if unknown:
            raise ValueError(f"generation defaults: unknown sampling fields {sorted(unknown)}")
        try:
            SamplingParams(**fields)  # the same rules a request's values meet
        except ValueError as exc:
            raise ValueError(f"{self.source or 'generation defaults'}: {exc}") from None
        object.__setattr__(self, "values", tuple(sorted(fields.items())))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def fill(self, given: dict[str, Any]) -> dict[str, Any]:
        """`given` (SamplingParams fields a client set) completed with the defaults it does not override."""
        return {**self.as_dict(), **given}

    def sampling_params(self, **given: Any) -> SamplingParams:
        """SamplingParams with these defaults under the fields given (vLLM's `get_default_sampling_params`)."""
        return SamplingParams(**self.fill(given))


def load_generation_defaults(setting: str, model_dir: str | Path) -> GenerationDefaults:
    """`setting`: "auto" (the checkpoint's own file, if it has one), "none" / "vllm" (no defaults), or a folder
    holding a generation_config.json. A file that is not valid JSON or holds invalid values is a ValueError."""
    if setting in NO_DEFAULTS:
        return GenerationDefaults()
    folder = Path(model_dir) if setting == "auto" else Path(setting)
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no {GENERATION_CONFIG_FILE} there; give a folder "
                             f"that has one, 'auto' (the model's own) or 'none'")
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    values = {field: raw[key] for key, field in SAMPLING_KEYS.items() if raw.get(key) is not None}
    defaults = GenerationDefaults(tuple(values.items()), str(path))
    if values:
        logger.info("sampling defaults from %s (a request's own values win): %s", path, defaults.as_dict())
    return defaults
