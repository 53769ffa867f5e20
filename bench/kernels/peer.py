"""Loads mamba_ssm 2.3.2's Triton ops from an unpacked sdist (side-by-side benchmarks only; never committed).

The package's __init__ imports its CUDA extensions, so stub packages with the right __path__ are put in
sys.modules and only the pure-Triton modules under mamba_ssm/ops/triton are imported.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

DEFAULT_ROOT = Path(__file__).resolve().parents[2] / ".peer" / "mamba_ssm-2.3.2.post1"


def load_peer(root: Path = DEFAULT_ROOT) -> dict[str, Any]:
    """{'mamba_chunk_scan_combined': fn, 'selective_state_update': fn} or raise ImportError with the cause."""
    pkg_dir = root / "mamba_ssm"
    if not pkg_dir.is_dir():
        raise ImportError(f"mamba_ssm sources not found under {root} (docs/benchmarks.md says how)")
    for name, sub in (("mamba_ssm", ""), ("mamba_ssm.ops", "ops"), ("mamba_ssm.ops.triton", "ops/triton"),
                      ("mamba_ssm.utils", "utils")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(pkg_dir / sub)]  # type: ignore[attr-defined]
            sys.modules[name] = module
    combined = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    ssu = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    return {
        "mamba_chunk_scan_combined": combined.mamba_chunk_scan_combined,
        "selective_state_update": ssu.selective_state_update,
    }
