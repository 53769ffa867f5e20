"""Replay rollback of the SSM state for speculative decoding: the cache layout and the pure-torch ops.

A slot holds the state *before* its previous verify step plus that step's inputs (x, B, processed dt and the
in-step cumsum of dt * A) in a `ReplayCache`; the next verify first folds the accepted ones into the state
("replay"), then scores its own T tokens without writing their states. The Triton kernels
(`replay_state_update_triton.py`) share this layout exactly: x single-buffered, B / dt / cumsum double-buffered
with `buf[slot]` naming the buffer of the last step.

  S_k = exp(cum_{k-1}) S_0 + sum_{j<k} exp(cum_{k-1} - cum_j) dt_j x_j B_j^T    (k accepted tokens)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridserve.kernels.ssd_scan import NO_DT_LIMIT, DtLimit, process_dt
from hybridserve.kernels.state_update import multi_token_state_update_ref


@dataclass
class ReplayCache:
    """Per-slot replay inputs of one Mamba layer; zero-initialised (nothing to replay)."""

    prev_x: torch.Tensor  # [slots, T, H, P] x of the previous step (x's dtype)
    prev_B: torch.Tensor  # [slots, 2, T, G, N] B, double-buffered
    prev_dt: torch.Tensor  # [slots, 2, T, H] fp32 processed dt
    prev_cum: torch.Tensor  # [slots, 2, T, H] fp32 in-step cumsum of dt * A
    buf: torch.Tensor  # [slots] int32 buffer holding the last step

    @staticmethod
    def allocate(num_slots: int, tokens: int, heads: int, head_dim: int, groups: int, state: int,
                 dtype: torch.dtype, device: torch.device | str) -> ReplayCache:
        z: dict[str, Any] = dict(device=device)
        return ReplayCache(
            prev_x=torch.zeros(num_slots, tokens, heads, head_dim, dtype=dtype, **z),
            prev_B=torch.zeros(num_slots, 2, tokens, groups, state, dtype=dtype, **z),
            prev_dt=torch.zeros(num_slots, 2, tokens, heads, dtype=torch.float32, **z),
            prev_cum=torch.zeros(num_slots, 2, tokens, heads, dtype=torch.float32, **z),
            buf=torch.zeros(num_slots, dtype=torch.int32, **z),
        )

    @property
    def tokens(self) -> int:
        return self.prev_x.shape[1]

    def nbytes(self) -> int:
        tensors = (self.prev_x, self.prev_B, self.prev_dt, self.prev_cum, self.buf)
        return sum(t.numel() * t.element_size() for t in tensors)


def advance_states(
    state_pool: torch.Tensor,  # [rows, H, P, N]
    cache: ReplayCache,
    source_slots: torch.Tensor,  # [R] slots whose state and last-step inputs are read
    target_rows: torch.Tensor,  # [R] rows that receive the advanced state (may equal source_slots)
    counts: torch.Tensor,  # [R] tokens of the last step to fold in, 0..T
    A: torch.Tensor,  # [H]
) -> None:
    """state_pool[target] = the source slot's state advanced by its first `counts` replay tokens."""
    if source_slots.numel() == 0:
        return
    src = source_slots.long()
    counts = counts.to(device=state_pool.device).long()
    state = state_pool[src].float()  # [R, H, P, N]
    buf = cache.buf[src].long()
    rows = torch.arange(src.numel(), device=src.device)
    x = cache.prev_x[src].float()  # [R, T, H, P]
    B = cache.prev_B[src, buf].float()  # [R, T, G, N]
    dt = cache.prev_dt[src, buf]  # [R, T, H]
    cum = cache.prev_cum[src, buf]  # [R, T, H]
    tokens = x.shape[1]
    keep = torch.arange(tokens, device=src.device)[None, :] < counts[:, None]  # [R, T]
    last = (counts - 1).clamp(min=0)
    cum_last = cum[rows, last]  # [R, H]
    coef = torch.where(keep[..., None], torch.exp(cum_last[:, None, :] - cum) * dt, 0.0)  # [R, T, H]
    B_heads = B.repeat_interleave(x.shape[2] // B.shape[2], dim=2)  # [R, T, H, N]
    update = torch.einsum("rth,rthp,rthn->rhpn", coef, x, B_heads)
    decay = torch.where(counts[:, None] > 0, torch.exp(cum_last), 1.0)  # [R, H]
    advanced = state * decay[:, :, None, None] + update
    state_pool[target_rows.long()] = advanced.to(state_pool.dtype)


def replay_state_update_ref(
    state_pool: torch.Tensor,  # [num_slots, H, P, N] the slots' states before the previous step
    cache: ReplayCache,
    slots: torch.Tensor,  # [B] int, -1 = padded row
    num_accepted: torch.Tensor,  # [B] tokens of the previous step to fold in (0..T)
    x: torch.Tensor,  # [B, T, H, P]
    dt: torch.Tensor,  # [B, T, H] raw
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [B, T, G, N]
    C: torch.Tensor,  # [B, T, G, N]
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_DT_LIMIT,
    z: torch.Tensor | None = None,
) -> torch.Tensor:
    """One verify step by replay (the contract of `replay_state_update_triton`); returns y [B, T, H, P]."""
    if cache.tokens != x.shape[1]:
        raise ValueError(f"replay cache holds {cache.tokens} tokens per step, the step has {x.shape[1]}")
    valid = slots >= 0
    live = slots[valid].long()
    advance_states(state_pool, cache, live, live, num_accepted[valid], A)
    y = multi_token_state_update_ref(
        state_pool, slots, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, z=z,
        write_final_state=False,
    )
    if live.numel():
        dt_p = process_dt(dt[valid], dt_bias, dt_softplus, dt_limit)  # [R, T, H]
        write = 1 - cache.buf[live].long()
        cache.prev_x[live] = x[valid].to(cache.prev_x.dtype)
        cache.prev_B[live, write] = B[valid].to(cache.prev_B.dtype)
        cache.prev_dt[live, write] = dt_p
        cache.prev_cum[live, write] = torch.cumsum(dt_p * A.float(), dim=1)
        cache.buf[live] = write.to(cache.buf.dtype)
    return y
