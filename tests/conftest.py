"""Shared test set-up: tests import helpers from this folder (`from checkpoints import ...`)."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
import torch

# the default model is written on first use; keep test runs from touching the user's cache
os.environ.setdefault("HYBRIDSERVE_CACHE", tempfile.mkdtemp(prefix="hybridserve-test-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every Ray cluster the tests start is a throwaway local one: token auth off for all of them. Ray reads the
# mode once per process, so one test turning it off and the next starting a cluster with the default made
# the second cluster's GCS refuse this driver (InvalidAuthToken) in full-suite runs
os.environ["RAY_AUTH_MODE"] = "disabled"
# Triton kernel tests run in Triton's CPU interpreter where there is no GPU; the switch must be set before
# anything imports triton (transformers does, through the checkpoint helpers), so it lives here
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="module")
def _no_router_left_running() -> Iterator[None]:
    """Every test module closes the orchestrators it makes: a cache subscriber left running reconnects to its
    worker's port forever, and once a later test's server gets that port (ports are reused) the stray calls
    land on it (a CI run failed that way)."""
    before = {t.ident for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + 10  # subscribers retired by update_workers stop on threads of their own
    while True:
        left = [t.name for t in threading.enumerate()
                if t.ident not in before and t.name.startswith("cache-events-") and t.is_alive()]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if left:
        pytest.fail(f"cache subscribers still running after the module: {left}; close() the Orchestrator / Router")
