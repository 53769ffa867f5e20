"""What the section-based benchmarks (kernels.py, moe.py, ncu_profile.py) share: run each section, keep going
past a broken one, and write the JSON."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch


def run_sections(sections: dict[str, Callable[[], Any]], skip: Iterable[str], into: dict[str, Any]) -> None:
    """Run every section not in `skip` into `into[name]`; a failing section records its traceback instead, so
    one broken row does not lose the others. The CUDA cache is emptied between sections."""
    skipped = set(skip)
    for name, run in sections.items():
        if name in skipped:
            continue
        try:
            into[name] = run()
        except Exception:  # noqa: BLE001 - record and keep going
            into[name] = {"error": traceback.format_exc()}
            print(f"{name} failed:\n{into[name]['error']}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def write_json(result: dict[str, Any], out: Path | None) -> None:
    """Write the result where --out says (parents created); nothing without --out."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
