"""On / off environment switches (HYBRIDSERVE_*) for comparing a measured default with its alternative.

One parser for all of them, so every switch takes the same values and rejects the rest the same way; it lives at
the bottom of the package so kernels, engine and workers can all read switches without importing each other.
"""

from __future__ import annotations

import os


def env_switch(name: str, default: bool) -> bool:
    """"1" or "0", `default` when unset; any other value is a ValueError naming the variable."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
