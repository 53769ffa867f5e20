"""Shared test set-up: tests import helpers from this folder (`from checkpoints import ...`)."""

from __future__ import annotations

import os
import tempfile

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
