"""Selective state update: the Mamba2 recurrence one token (decode) or T tokens (verify) at a time.

h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t;  y_t = C_t . h_t + D * x_t  (optionally * silu(z_t)).
States live in a pool of slots ([num_slots, H, P, N]); a slot index of -1 marks a padded row, skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.kernels.ssd_scan import NO_DT_LIMIT, DtLimit, process_dt


def _step(
    state: torch.Tensor,  # [B, H, P, N] fp32
    x: torch.Tensor,  # [B, H, P] fp32
    dt: torch.Tensor,  # [B, H] fp32, processed
    A: torch.Tensor,  # [H] fp32
    B: torch.Tensor,  # [B, G, N] fp32
    C: torch.Tensor,  # [B, G, N] fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step: returns (new state, C . new state [B, H, P])."""
    heads_per_group = x.shape[1] // B.shape[1]
    B_heads = B.repeat_interleave(heads_per_group, dim=1)  # [B, H, N]
    C_heads = C.repeat_interleave(heads_per_group, dim=1)
    decay = torch.exp(dt * A)[:, :, None, None]
    state = state * decay + (dt[:, :, None] * x)[..., None] * B_heads[:, :, None, :]
    return state, torch.einsum("bhpn,bhn->bhp", state, C_heads)


def multi_token_state_update_ref(
    state_pool: torch.Tensor,  # [num_slots, H, P, N]; read at `slots`, final state written back there
    slots: torch.Tensor,  # [B] int, -1 = padded row (left untouched, output zeros)
    x: torch.Tensor,  # [B, T, H, P]
    dt: torch.Tensor,  # [B, T, H] raw
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [B, T, G, N]
    C: torch.Tensor,  # [B, T, G, N]
    D: torch.Tensor | None = None,  # [H]
    dt_bias: torch.Tensor | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_DT_LIMIT,
    z: torch.Tensor | None = None,  # [B, T, H, P]
    intermediate_states: torch.Tensor | None = None,  # [B, T, H, P, N] out: state after every token
    write_final_state: bool = True,
) -> torch.Tensor:
    """T-token update per sequence; returns y [B, T, H, P] in x's dtype."""
    valid = slots >= 0
    safe_slots = slots.clamp(min=0).long()
    state = state_pool[safe_slots].float()
    dt_p = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    A32 = A.float()
    outputs = []
    for t in range(x.shape[1]):
        state, y_t = _step(state, x[:, t].float(), dt_p[:, t], A32, B[:, t].float(), C[:, t].float())
        if intermediate_states is not None:
            intermediate_states[valid, t] = state[valid].to(intermediate_states.dtype)
        outputs.append(y_t)
    y = torch.stack(outputs, dim=1)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    y = torch.where(valid[:, None, None, None], y, torch.zeros_like(y))
    if write_final_state and bool(valid.any()):
        state_pool[safe_slots[valid]] = state[valid].to(state_pool.dtype)
    return y.to(x.dtype)
