"""Fixtures of the router tests: the tiny checkpoint and a 1 prefill + 1 decode cluster."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from router_cluster import Cluster, tiny_model_dir


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="module")
def cluster(model_dir):
    c = Cluster(model_dir, num_prefill=1, num_decode=1)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    """The official OpenAI client on the cluster's HTTP door (modules with slower requests override it)."""
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
