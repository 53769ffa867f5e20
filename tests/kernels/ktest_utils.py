"""Helpers for the Triton kernel tests: interpreter set-up, markers, error metrics.

Import this module before anything that imports triton: without CUDA it turns on TRITON_INTERPRET=1 so the
kernels run in Triton's CPU interpreter (tiny shapes, CI); with CUDA the same kernels are compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp_only = pytest.mark.skipif(not INTERPRETING, reason="interpreter test (CPU tensors, TRITON_INTERPRET=1)")
gpu = pytest.mark.gpu
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# relative L2 error allowed per dtype of the data the kernel reads / writes
TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    """Fail with the measured error when out is farther than tol (relative L2) from ref."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.1e}"


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """An output buffer full of NaN, so any element the kernel fails to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
