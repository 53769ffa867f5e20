"""The torch replay rollback (`kernels/replay_state_update.py`) against the per-token recurrence: folding k accepted
tokens of the previous step gives the state after those tokens, the outputs equal the intermediate-state
method's, and `advance_states` rebuilds any prefix of a step into another row (prefix-cache checkpoints)."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels.replay_state_update import ReplayCache, advance_states, replay_state_update_ref
from hybridserve.kernels.state_update import multi_token_state_update_ref

SLOTS, T, H, P, G, N = 5, 4, 4, 8, 2, 6


def _inputs(gen: torch.Generator, batch: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(batch, T, H, P, generator=gen)
    dt = torch.randn(batch, T, H, generator=gen)
    B = torch.randn(batch, T, G, N, generator=gen)
    C = torch.randn(batch, T, G, N, generator=gen)
    return x, dt, B, C


@pytest.mark.parametrize("accepted", [[0, 0], [4, 1], [2, 3]])
def test_replay_equals_per_token_states(accepted: list[int]) -> None:
    gen = torch.Generator().manual_seed(sum(accepted))
    A = -torch.rand(H, generator=gen) - 0.5
    D, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    kw = dict(D=D, dt_bias=dt_bias)
    slots = torch.tensor([3, 1])
    replay_pool = torch.randn(SLOTS, H, P, N, generator=gen)
    oracle_pool = replay_pool.clone()
    cache = ReplayCache.allocate(SLOTS, T, H, P, G, N, torch.float32, "cpu")
    # step 1: nothing to fold in yet
    step1 = _inputs(gen, 2)
    inter = torch.empty(2, T, H, P, N)
    y_oracle = multi_token_state_update_ref(oracle_pool, slots, *step1[:2], A, *step1[2:], intermediate_states=inter,
                                            write_final_state=False, **kw)
    y_replay = replay_state_update_ref(replay_pool, cache, slots, torch.tensor([0, 0]), *step1[:2], A, *step1[2:], **kw)
    torch.testing.assert_close(y_replay, y_oracle)
    # the oracle keeps the state after each row's accepted tokens; replay folds them in at step 2
    for row, k in enumerate(accepted):
        if k:
            oracle_pool[slots[row]] = inter[row, k - 1]
    step2 = _inputs(gen, 2)
    y_oracle = multi_token_state_update_ref(oracle_pool, slots, *step2[:2], A, *step2[2:], write_final_state=False, **kw)
    y_replay = replay_state_update_ref(replay_pool, cache, slots, torch.tensor(accepted), *step2[:2], A, *step2[2:],
                                       **kw)
    torch.testing.assert_close(y_replay, y_oracle, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(replay_pool[slots], oracle_pool[slots], rtol=1e-4, atol=1e-4)


def test_advance_states_rebuilds_any_prefix_of_the_last_step() -> None:
    gen = torch.Generator().manual_seed(7)
    A = -torch.rand(H, generator=gen) - 0.5
    slots = torch.tensor([2])
    pool = torch.randn(SLOTS, H, P, N, generator=gen)
    start = pool[2].clone()
    cache = ReplayCache.allocate(SLOTS, T, H, P, G, N, torch.float32, "cpu")
    x, dt, B, C = _inputs(gen, 1)
    replay_state_update_ref(pool, cache, slots, torch.tensor([0]), x, dt, A, B, C)
    inter = torch.empty(1, T, H, P, N)
    multi_token_state_update_ref(pool.clone(), slots, x, dt, A, B, C, intermediate_states=inter)
    assert torch.equal(pool[2], start)  # replay leaves the slot at the state before the step
    for count in range(1, T + 1):
        advance_states(pool, cache, slots, torch.tensor([4]), torch.tensor([count]), A)
        torch.testing.assert_close(pool[4], inter[0, count - 1], rtol=1e-4, atol=1e-4)
