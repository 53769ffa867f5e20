"""Triton varlen SSD scan against the torch reference: y, final states and every aligned chunk-end state,
for sequences that start mid-chunk (resumed after a cached prefix) and from initial states."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels.ssd_scan import ssd_scan_varlen_ref  # noqa: E402
from hybridserve.kernels.ssd_scan_triton import ssd_scan_varlen_triton  # noqa: E402


def _check(lens, starts, heads, head_dim, groups, state, chunk, state_block, dtype, device, gen, tol, with_init=True):
    total = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)
    x, dt = r(total, heads, head_dim), r(total, heads, scale=0.5)
    B, C = r(total, groups, state), r(total, groups, state)
    A = -(torch.rand(heads, generator=gen) * 2 + 0.1).to(device)
    D, bias = torch.randn(heads, generator=gen).to(device), (torch.randn(heads, generator=gen) * 0.5).to(device)
    # initial states as a strided view of a request-major pool, zero for fresh sequences
    pool = torch.randn(len(lens), 2, heads, head_dim, state, generator=gen).to(device)
    init = pool[:, 1] * (torch.tensor(starts, device=device) > 0).float()[:, None, None, None]
    sp = torch.tensor(starts, device=device)
    kw = dict(D=D, dt_bias=bias, dt_limit=(0.001, 5.0), initial_states=init if with_init else None,
              start_positions=sp,
              state_block=state_block)
    ref = ssd_scan_varlen_ref(x, dt, A, B, C, cu, chunk, **kw)
    got = ssd_scan_varlen_triton(x, dt, A, B, C, cu, chunk, **kw)
    ku.assert_close(got.y, ref.y, tol, "y")
    ku.assert_close(got.final_states, ref.final_states, tol, "final states")
    assert torch.equal(got.chunk_state_seq.cpu(), ref.chunk_state_seq.cpu())
    assert torch.equal(got.chunk_state_pos.cpu(), ref.chunk_state_pos.cpu())
    assert got.chunk_states.shape == ref.chunk_states.shape
    for i in range(ref.chunk_states.shape[0]):
        ku.assert_close(got.chunk_states[i], ref.chunk_states[i], tol, f"chunk state {i}")


@ku.interp_only
def test_ssd_scan_interpreter():
    gen = torch.Generator().manual_seed(0)
    # a fresh sequence, two resumed mid-chunk, an empty one; chunk 16, kept states every 32 tokens
    _check([5, 40, 0, 23], [0, 7, 3, 33], 4, 12, 2, 16, 16, 32, torch.float32, "cpu", gen, 2e-3)
    _check([20, 33], [0, 0], 2, 16, 1, 16, 16, None, torch.float32, "cpu", gen, 2e-3, with_init=False)
    # the tiny test checkpoints' shapes: chunk 8, state 8 (blocks padded to the 16 tl.dot needs)
    _check([11, 6], [0, 5], 4, 16, 2, 8, 8, 8, torch.float32, "cpu", gen, 2e-3)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize(
    "shape",
    [(128, 80, 8, 128, 128, 256), (80, 64, 1, 128, 256, 256)],  # Nano-9B-v2 (chunk 128), mamba2-2.7b (256)
)
@pytest.mark.parametrize("lens,starts", [([1000, 37, 513], [0, 300, 129]), ([2048], [0])])
def test_ssd_scan_gpu(shape, lens, starts):
    heads, head_dim, groups, state, chunk, block = shape
    gen = torch.Generator().manual_seed(sum(lens))
    _check(lens, starts, heads, head_dim, groups, state, chunk, block, torch.bfloat16, "cuda", gen, 3e-2)
