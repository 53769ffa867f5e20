"""Replay-method verify (checkpoint state + previous step's inputs) against advancing the reference state
through the accepted tokens and scoring the new ones, over several steps with varying acceptance."""

from __future__ import annotations

from typing import Any

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels.replay_state_update import ReplayCache  # noqa: E402
from hybridserve.kernels.replay_state_update_triton import replay_state_update_triton  # noqa: E402
from hybridserve.kernels.state_update import multi_token_state_update_ref  # noqa: E402


def replay_reference(
    state_pool: torch.Tensor, history: dict, slots: torch.Tensor, num_accepted: torch.Tensor, x: torch.Tensor,
    dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, **kw: Any
) -> torch.Tensor:
    """The oracle: advance each slot through its accepted previous tokens (kept in `history`, keyed by slot),
    then score the new tokens without writing the state; records the new tokens in `history`."""
    for row, slot in enumerate(slots.tolist()):
        if slot < 0 or slot not in history or int(num_accepted[row]) == 0:
            continue
        k = int(num_accepted[row])
        hx, hdt, hB, hC, hz = history[slot]
        sl = torch.tensor([slot], device=x.device)
        multi_token_state_update_ref(state_pool, sl, hx[None, :k], hdt[None, :k], A, hB[None, :k], hC[None, :k],
                                     **{**kw, "z": None})
    y = multi_token_state_update_ref(state_pool, slots, x, dt, A, B, C, write_final_state=False, **kw)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            history[slot] = (x[row], dt[row], B[row], C[row], None)
    return y


def _run(batch, tokens, heads, head_dim, groups, state, state_dtype, dtype, device, gen, tol, dot_outputs=True):
    num_slots = batch + 2
    pool = torch.randn(num_slots, 2, heads, head_dim, state, generator=gen).to(device=device, dtype=state_dtype)[:, 0]
    ref_pool = pool.clone()
    slots = torch.randperm(num_slots, generator=gen)[:batch].to(device)
    slots[1] = -1
    cache = ReplayCache.allocate(num_slots, tokens, heads, head_dim, groups, state, dtype, device)
    A = -torch.rand(heads, generator=gen).to(device) - 0.5
    D, bias = torch.randn(heads, generator=gen).to(device), (torch.randn(heads, generator=gen) * 0.5).to(device)
    history: dict = {}
    accepted = torch.zeros(batch, dtype=torch.int32, device=device)
    for step in range(3):
        def r(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)
        x, z, dt = r(batch, tokens, heads, head_dim), r(batch, tokens, heads, head_dim), r(batch, tokens, heads)
        B, C = r(batch, tokens, groups, state), r(batch, tokens, groups, state)
        kw = dict(D=D, dt_bias=bias, dt_limit=(0.001, 2.0), z=z)
        y_ref = replay_reference(ref_pool, history, slots, accepted, x, dt, A, B, C, **kw)
        y = replay_state_update_triton(pool, cache, slots, accepted, x, dt, A, B, C, dot_outputs=dot_outputs, **kw)
        ku.assert_close(y, y_ref, tol, f"y at step {step}")
        valid = slots >= 0
        ku.assert_close(pool[slots[valid]].float(), ref_pool[slots[valid]].float(), tol, f"state at step {step}")
        accepted = torch.randint(0, tokens + 1, (batch,), generator=gen).to(device=device, dtype=torch.int32)


@ku.interp_only
@pytest.mark.parametrize("dot_outputs", [True, False])
def test_replay_interpreter(dot_outputs):
    gen = torch.Generator().manual_seed(7)
    _run(3, 3, 4, 12, 2, 8, torch.float32, torch.float32, "cpu", gen, 2e-3, dot_outputs)


@ku.interp_only
@pytest.mark.parametrize("heads,groups", [(6, 2), (20, 1)])
def test_replay_head_blocks_interpreter(heads, groups):
    """The precompute's head blocks: 3 heads per group (a masked block of 4), 20 (blocks of 16, the last short)."""
    gen = torch.Generator().manual_seed(9)
    _run(2, 2, heads, 4, groups, 8, torch.float32, torch.float32, "cpu", gen, 2e-3)


def test_replay_rejects_groups_not_dividing_heads():
    pool = torch.zeros(2, 3, 4, 8)
    cache = ReplayCache.allocate(2, 2, 3, 4, 2, 8, torch.float32, "cpu")
    x, dt = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)
    B = C = torch.zeros(1, 2, 2, 8)
    with pytest.raises(ValueError, match="must divide"):
        replay_state_update_triton(pool, cache, torch.tensor([0]), torch.tensor([0]), x, dt, torch.zeros(3), B, C)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dot_outputs", [True, False])
def test_replay_gpu(state_dtype, dot_outputs):
    tol = 2e-2 if state_dtype == torch.bfloat16 else 1e-2
    gen = torch.Generator().manual_seed(8)
    _run(24, 4, 128, 80, 8, 128, state_dtype, torch.bfloat16, "cuda", gen, tol, dot_outputs)
