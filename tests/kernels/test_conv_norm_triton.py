"""Triton causal conv1d (varlen prefill with boundary windows, decode / verify update) and gated RMSNorm
against the torch references."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels.causal_conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref  # noqa: E402
from hybridserve.kernels.causal_conv1d_triton import (  # noqa: E402
    causal_conv1d_update_triton,
    causal_conv1d_varlen_triton,
)
from hybridserve.kernels.gated_rmsnorm import gated_rmsnorm_ref, rmsnorm_ref  # noqa: E402
from hybridserve.kernels.gated_rmsnorm_triton import gated_rmsnorm_triton, rmsnorm_triton  # noqa: E402


def _conv_varlen(lens, starts, channels, kernel, width, dtype, device, gen, tol):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)
    proj = torch.randn(sum(lens), channels + 5, generator=gen).to(device=device, dtype=dtype)
    x = proj[:, 3 : 3 + channels]  # a strided column slice, like xBC from in_proj
    weight = torch.randn(channels, kernel, generator=gen).to(device=device, dtype=dtype)
    bias = torch.randn(channels, generator=gen).to(device=device, dtype=dtype)
    pool = torch.randn(len(lens), 2, channels, width, generator=gen).to(device)
    for init in (pool[:, 1], None):
        kw = dict(start_positions=torch.tensor(starts, device=device), state_block=8, window_width=width)
        ref = causal_conv1d_varlen_ref(x, weight, bias, cu, init, **kw)
        got = causal_conv1d_varlen_triton(x, weight, bias, cu, init, **kw)
        ku.assert_close(got.y, ref.y, tol, "conv y")
        ku.assert_close(got.final_windows, ref.final_windows, tol, "final windows")
        ku.assert_close(got.boundary_windows, ref.boundary_windows, tol, "boundary windows")
        assert torch.equal(got.boundary_seq.cpu(), ref.boundary_seq.cpu())
        assert torch.equal(got.boundary_pos.cpu(), ref.boundary_pos.cpu())


def _conv_update(batch, tokens, channels, kernel, width, dtype, device, gen, tol):
    cache = torch.randn(batch + 2, 3, channels, width, generator=gen).to(device=device, dtype=dtype)
    pool = cache[:, 2]
    slots = torch.randperm(batch + 2, generator=gen)[:batch].to(device)
    slots[0] = -1
    x = torch.randn(batch, tokens, channels, generator=gen).to(device=device, dtype=dtype)
    weight = torch.randn(channels, kernel, generator=gen).to(device=device, dtype=dtype)
    bias = torch.randn(channels, generator=gen).to(device=device, dtype=dtype)
    ref_pool = pool.clone()
    ref = causal_conv1d_update_ref(x, ref_pool, slots, weight, bias)
    out = ku.poisoned(tuple(x.shape), dtype, device)
    got = causal_conv1d_update_triton(x, pool, slots, weight, bias, out=out)
    ku.assert_close(got, ref, tol, "conv update y")
    assert torch.equal(pool, ref_pool), "conv windows differ from the reference"


def _norm(rows, dim, groups, dtype, device, gen, tol):
    proj = torch.randn(rows, 2 * dim + 3, generator=gen).to(device=device, dtype=dtype)
    x, z = proj[:, :dim], proj[:, dim + 3 :]
    weight = torch.randn(dim, generator=gen).to(device=device, dtype=dtype)
    ku.assert_close(gated_rmsnorm_triton(x, z, weight, dim // groups, 1e-5),
                    gated_rmsnorm_ref(x, z, weight, dim // groups, 1e-5), tol, "gated rmsnorm")
    ku.assert_close(rmsnorm_triton(x, weight, 1e-5), rmsnorm_ref(x, weight, 1e-5), tol, "rmsnorm")


@ku.interp_only
def test_conv_and_norm_interpreter():
    gen = torch.Generator().manual_seed(1)
    _conv_varlen([5, 1, 19, 2], [0, 4, 6, 7], 20, 4, 5, torch.float32, "cpu", gen, 1e-5)
    _conv_update(3, 4, 20, 4, 6, torch.float32, "cpu", gen, 1e-5)
    _conv_update(2, 1, 20, 4, 3, torch.float32, "cpu", gen, 1e-5)
    _norm(3, 24, 2, torch.float32, "cpu", gen, 1e-5)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conv_and_norm_gpu(dtype):
    gen = torch.Generator().manual_seed(2)
    tol = ku.TOL[dtype]
    _conv_varlen([1000, 37, 513], [0, 300, 129], 12288, 4, 6, dtype, "cuda", gen, tol)
    _conv_update(64, 4, 12288, 4, 6, dtype, "cuda", gen, tol)
    _conv_update(32, 1, 12288, 4, 3, dtype, "cuda", gen, tol)
    _norm(77, 10240, 8, dtype, "cuda", gen, tol)
