"""Fixtures of the benchmark tests: a live tiny server (bench/ and the router test helpers are on pytest's pythonpath)."""

from __future__ import annotations

import pytest
from router_cluster import Cluster, tiny_model_dir


@pytest.fixture(scope="module")
def server():
    """One prefill and one decode worker in this process behind the router's HTTP door (max_model_len 256)."""
    c = Cluster(tiny_model_dir(), num_prefill=1, num_decode=1)
    yield c
    c.stop()
