"""Package attributes imported on first use (PEP 562): a package can list its public names without importing
the modules behind them, so importing one light module of it (as the router does) loads nothing heavy."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` that imports `exports[name]` (a module path) and returns its `name`."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
