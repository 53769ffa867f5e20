"""Fixtures of the benchmark tests: bench/ and the router test helpers importable, and a live tiny server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "router"))
sys.path.insert(0, str(TESTS.parent / "bench"))

from router_cluster import Cluster, tiny_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def server():
    """One prefill and one decode worker in this process behind the router's HTTP door (max_model_len 256)."""
    c = Cluster(tiny_model_dir(), num_prefill=1, num_decode=1)
    yield c
    c.stop()
