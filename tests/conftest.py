"""Shared test set-up: tests import helpers from this folder (`from checkpoints import ...`)."""

from __future__ import annotations

import os
import tempfile

import torch

# the default model is written on first use; keep test runs from touching the user's cache
os.environ.setdefault("HYBRIDSERVE_CACHE", tempfile.mkdtemp(prefix="hybridserve-test-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernel tests run in Triton's CPU interpreter where there is no GPU; the switch must be set before
# anything imports triton (transformers does, through the checkpoint helpers), so it lives here
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
