"""Fixtures of the benchmark tests: a live tiny server (bench/<topic>/, tools/demo_model/ and the router test helpers
are on pytest's pythonpath)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
from router_cluster import Cluster, tiny_model_dir


@pytest.fixture(scope="module")
def server():
    """One prefill and one decode worker in this process behind the router's HTTP door (max_model_len 256)."""
    c = Cluster(tiny_model_dir(), num_prefill=1, num_decode=1)
    yield c
    c.stop()


@pytest.fixture
def train_demo(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """tools/demo_model/train_demo.py imported for one test: it takes its own folder off sys.path and re-imports its
    train_demo_* siblings, so sys.path and those modules are put back as they were afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("train_demo", *(f"train_demo_{part}" for part in ("data", "mtp", "card", "eval", "scan", "args",
                                                                     "ditto"))):
        if name in sys.modules:  # this module's copy comes back afterwards
            monkeypatch.setitem(sys.modules, name, sys.modules[name])
        else:  # recorded as absent, so the import below is removed afterwards
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
            del sys.modules[name]
    return importlib.import_module("train_demo")
