"""Speculative-decoding configuration (`LLM(..., speculative_config={...})`), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("mtp", "ngram")
ROLLBACKS = ("intermediate", "replay")
MAX_SPECULATIVE_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """K drafts per step from the checkpoint's MTP module or from prompt lookup (n-gram), verified in one
    target pass; the SSM state rolls back by keeping a state per draft ("intermediate") or by replaying
    the accepted tokens at the next verify ("replay")."""

    method: str
    num_speculative_tokens: int
    rollback: str = "replay"  # measured faster and ~200x smaller than "intermediate" (bench/results/h200)
    prompt_lookup_min: int = 1  # n-gram: shortest suffix to look up
    prompt_lookup_max: int = 4  # n-gram: longest suffix to look up

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}"
            )
        if self.rollback not in ROLLBACKS:
            raise ValueError(f"speculative_config rollback must be one of {ROLLBACKS}, got {self.rollback!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}")

    @property
    def num_verify_tokens(self) -> int:
        """T: the last token plus K drafts."""
        return self.num_speculative_tokens + 1

    @staticmethod
    def parse(value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """A config from what a user passes: None, a SpeculativeConfig or a dict of its fields."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {type(value).__name__}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r}")
        return SpeculativeConfig(**value)
