"""Triton selective state update (decode and multi-token intermediate) against the torch reference."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels.state_update import multi_token_state_update_ref  # noqa: E402
from hybridserve.kernels.state_update_triton import (  # noqa: E402
    multi_token_state_update_triton,
)


def _inputs(batch, tokens, heads, head_dim, groups, state, state_dtype, dtype, device, gen):
    """Random inputs; the pool is a strided per-layer view of a request-major cache [slots, layers, H, P, N]."""
    num_slots = batch + 3
    cache = torch.randn(num_slots, 2, heads, head_dim, state, generator=gen).to(device=device, dtype=state_dtype)
    pool = cache[:, 1]
    slots = torch.randperm(num_slots, generator=gen)[:batch].to(device)
    slots[batch // 2] = -1  # one padded row
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)
    x, z = r(batch, tokens, heads, head_dim), r(batch, tokens, heads, head_dim)
    dt = r(batch, tokens, heads, scale=0.5)
    A = -torch.rand(heads, generator=gen).to(device) * 4 - 0.5
    B, C = r(batch, tokens, groups, state), r(batch, tokens, groups, state)
    D, bias = torch.randn(heads, generator=gen).to(device), torch.randn(heads, generator=gen).to(device) * 0.5
    return pool, slots, x, z, dt, A, B, C, D, bias


def _check(batch, tokens, heads, head_dim, groups, state, state_dtype, dtype, device, use_z, inter, gen, **launch):
    pool, slots, x, z, dt, A, B, C, D, bias = _inputs(
        batch, tokens, heads, head_dim, groups, state, state_dtype, dtype, device, gen
    )
    ref_pool = pool.clone()
    kw = dict(D=D, dt_bias=bias, dt_limit=(0.01, 3.0), z=z if use_z else None)
    ref_inter = torch.zeros(batch, tokens, heads, head_dim, state, device=device) if inter else None
    y_ref = multi_token_state_update_ref(ref_pool, slots, x, dt, A, B, C, intermediate_states=ref_inter, **kw)
    out = ku.poisoned(tuple(x.shape), dtype, device)
    got_inter = ku.poisoned((batch, tokens, heads, head_dim, state), torch.float32, device) if inter else None
    before = pool.clone()
    y = multi_token_state_update_triton(
        pool, slots, x, dt, A, B, C, intermediate_states=got_inter, out=out, **kw, **launch
    )
    tol = ku.TOL[dtype] if state_dtype == torch.float32 else ku.TOL[torch.bfloat16]
    ku.assert_close(y, y_ref, tol, "y")
    valid = slots >= 0
    ku.assert_close(pool[slots[valid]].float(), ref_pool[slots[valid]].float(), tol, "state")
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=device)
    untouched[slots[valid]] = False
    assert torch.equal(pool[untouched], before[untouched]), "a slot outside the batch was written"
    assert (y[~valid] == 0).all(), "padded rows must output zeros"
    if inter:
        ku.assert_close(got_inter[valid], ref_inter[valid], tol, "intermediate states")


@ku.interp_only
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,inter,use_z", [(1, False, False), (3, True, True)])
def test_state_update_interpreter(state_dtype, tokens, inter, use_z):
    gen = torch.Generator().manual_seed(tokens * 7 + (state_dtype == torch.bfloat16))
    _check(3, tokens, 4, 8, 2, 16, state_dtype, torch.float32, "cpu", use_z, inter, gen)


@ku.interp_only
@pytest.mark.parametrize("tiles,tokens", [(2, 1), (3, 2)])
def test_state_update_tiles_interpreter(tiles, tokens):
    """Several row tiles per program, head_dim not a multiple of block_p * tiles (masked last tiles)."""
    gen = torch.Generator().manual_seed(tiles)
    _check(3, tokens, 4, 20, 2, 16, torch.float32, torch.float32, "cpu", True, tokens > 1, gen, block_p=4,
           tiles=tiles)


def test_state_update_rejects_bad_tiles():
    gen = torch.Generator().manual_seed(0)
    pool, slots, x, z, dt, A, B, C, D, bias = _inputs(2, 1, 2, 8, 1, 16, torch.float32, torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match="tiles"):
        multi_token_state_update_triton(pool, slots, x, dt, A, B, C, tiles=0)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 80, 8, 128), (80, 64, 1, 128)])  # Nano-9B-v2, mamba2-2.7b
@pytest.mark.parametrize("batch,tokens,inter", [(1, 1, False), (37, 1, False), (64, 4, True)])
def test_state_update_gpu(state_dtype, shape, batch, tokens, inter):
    heads, head_dim, groups, state = shape
    gen = torch.Generator().manual_seed(batch * 31 + tokens)
    _check(batch, tokens, heads, head_dim, groups, state, state_dtype, torch.bfloat16, "cuda", True, inter, gen)
