"""SSD (Mamba2 state-space duality) chunked scan over packed variable-length sequences.

The reference walks each sequence in *logical chunks* whose ends land on absolute multiples of
`chunk_size`: a sequence resumed after a cached prefix of length n starts with a short chunk of
`chunk_size - n % chunk_size` tokens. So the states at chunk ends are exactly the states a prefix cache
wants to keep (positions that are multiples of `chunk_size`), whatever the prefix length was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridserve.kernels.ssd_scan_meta import ChunkMeta

DtLimit = tuple[float, float]
NO_DT_LIMIT: DtLimit = (0.0, math.inf)


@dataclass(frozen=True)
class SSDScanOutput:
    """What one varlen scan returns."""

    y: torch.Tensor  # [T, H, P] output (before gating), dtype of x
    final_states: torch.Tensor  # [S, H, P, N] fp32, the state after each sequence's last token
    chunk_states: torch.Tensor  # [K, H, P, N] fp32, state at every kept chunk end (absolute multiple of
    # chunk_size, and of state_block when given), in sequence then position order
    # (with a `state_pool` both are written into the pool instead and come back with 0 rows)
    chunk_state_seq: torch.Tensor  # [K] int64, the sequence each chunk state belongs to
    chunk_state_pos: torch.Tensor  # [K] int64, absolute token count at that chunk end


def process_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: DtLimit
) -> torch.Tensor:
    """dt -> clamp(softplus(dt + dt_bias)) in fp32. dt: [..., H]."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != NO_DT_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def check_pool_args(
    state_pool: torch.Tensor,  # [rows, H, P, N]
    slots: torch.Tensor | None,  # [S]
    checkpoint_rows: torch.Tensor | None,  # [K]
    initial_states: torch.Tensor | None,
    num_seqs: int,
) -> None:
    """Validate the pool-mode arguments of the scan (reference and Triton share the contract)."""
    if initial_states is not None:
        raise ValueError("pass either initial_states or state_pool (which supplies them through slots), not both")
    if state_pool.dim() != 4:
        raise ValueError(f"state_pool must be [rows, H, P, N], got shape {tuple(state_pool.shape)}")
    if slots is None or slots.dim() != 1 or slots.numel() != num_seqs:
        got = None if slots is None else tuple(slots.shape)
        raise ValueError(f"state_pool needs slots with one pool row per sequence ({num_seqs}), got {got}")
    if checkpoint_rows is not None and checkpoint_rows.dim() != 1:
        raise ValueError(f"checkpoint_rows must be 1-D (one row per kept state), got {tuple(checkpoint_rows.shape)}")


def _expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[L, G, N] -> [L, H, N]: head h reads group h // (H // G)."""
    return t.repeat_interleave(num_heads // t.shape[1], dim=1)


def ssd_chunk_ref(
    x: torch.Tensor,  # [L, H, P] fp32
    dt: torch.Tensor,  # [L, H] fp32, processed
    A: torch.Tensor,  # [H] fp32
    B: torch.Tensor,  # [L, H, N] fp32 (groups expanded)
    C: torch.Tensor,  # [L, H, N] fp32
    state: torch.Tensor,  # [H, P, N] fp32, state before the chunk
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the SSD algorithm in matrix form: returns (y [L, H, P], state after the chunk)."""
    dA_cumsum = torch.cumsum(dt * A, dim=0)  # [L, H]
    length = x.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    # segment decay exp(cum[i] - cum[j]) for j <= i, 0 above the diagonal: [H, L, L]
    seg = dA_cumsum.T[:, :, None] - dA_cumsum.T[:, None, :]
    decay = torch.exp(seg.masked_fill(~causal, -math.inf))
    scores = torch.einsum("lhn,shn->hls", C, B) * decay  # [H, L, S]
    y = torch.einsum("hls,sh,shp->lhp", scores, dt, x)
    # contribution of the incoming state, decayed to each position
    y = y + torch.einsum("lhn,hpn->lhp", C, state) * torch.exp(dA_cumsum)[:, :, None]
    decay_to_end = torch.exp(dA_cumsum[-1:] - dA_cumsum)  # [L, H]
    new_state = state * torch.exp(dA_cumsum[-1])[:, None, None] + torch.einsum(
        "lh,lhp,lhn->hpn", decay_to_end * dt, x, B
    )
    return y, new_state


def ssd_scan_varlen_ref(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H], raw (dt_bias / softplus / limit applied here)
    A: torch.Tensor,  # [H], negative
    B: torch.Tensor,  # [T, G, N]
    C: torch.Tensor,  # [T, G, N]
    cu_seqlens: torch.Tensor,  # [S + 1]
    chunk_size: int,
    D: torch.Tensor | None = None,  # [H]
    dt_bias: torch.Tensor | None = None,  # [H]
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_DT_LIMIT,
    initial_states: torch.Tensor | None = None,  # [S, H, P, N]; None means zeros
    start_positions: torch.Tensor | None = None,  # [S] absolute position of each sequence's first token
    state_block: int | None = None,  # keep only chunk-end states at multiples of this (None: every chunk end)
    state_pool: torch.Tensor | None = None,  # [rows, H, P, N] read/write states here (see `check_pool_args`)
    slots: torch.Tensor | None = None,  # [S] pool row of each sequence
    checkpoint_rows: torch.Tensor | None = None,  # [K] pool row of each kept state, -1 = not written
    meta: ChunkMeta | None = None,  # unused here (the Triton scan's precomputed chunk metadata)
    init_rows: torch.Tensor | None = None,  # unused here (the Triton scan's precomputed initial rows)
) -> SSDScanOutput:
    """Reference varlen SSD scan with chunk-aligned intermediate states (fp32 math).

    With `state_pool`, a sequence with start_positions > 0 starts from state_pool[slots[s]] (zeros otherwise),
    its final state goes to state_pool[slots[s]] and kept state k to state_pool[checkpoint_rows[k]]."""
    if state_pool is not None:
        check_pool_args(state_pool, slots, checkpoint_rows, initial_states, cu_seqlens.numel() - 1)
        assert slots is not None  # checked above
        resumed = torch.zeros_like(slots, dtype=torch.bool) if start_positions is None else start_positions > 0
        init = torch.where(resumed[:, None, None, None], state_pool[slots.long()].float(), 0.0)
        out = ssd_scan_varlen_ref(x, dt, A, B, C, cu_seqlens, chunk_size, D, dt_bias, dt_softplus, dt_limit, init,
                                  start_positions, state_block)
        state_pool[slots.long()] = out.final_states.to(state_pool.dtype)
        if checkpoint_rows is not None:
            if checkpoint_rows.numel() != out.chunk_states.shape[0]:
                raise ValueError(f"checkpoint_rows has {checkpoint_rows.numel()} entries for "
                                 f"{out.chunk_states.shape[0]} kept states")
            keep = checkpoint_rows >= 0
            state_pool[checkpoint_rows[keep].long()] = out.chunk_states[keep].to(state_pool.dtype)
        return SSDScanOutput(out.y, out.final_states[:0], out.chunk_states[:0], out.chunk_state_seq,
                             out.chunk_state_pos)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    keep_every = chunk_size if state_block is None else state_block
    if keep_every % chunk_size != 0:
        raise ValueError(f"state_block ({state_block}) must be a multiple of chunk_size ({chunk_size})")
    num_tokens, num_heads, head_dim = x.shape
    state_size = B.shape[-1]
    num_seqs = cu_seqlens.numel() - 1
    bounds = cu_seqlens.tolist()
    starts = [0] * num_seqs if start_positions is None else [int(s) for s in start_positions.tolist()]
    dt_all = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    A32 = A.float()
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=x.device)
    final_states = torch.empty(num_seqs, num_heads, head_dim, state_size, dtype=torch.float32, device=x.device)
    chunk_states: list[torch.Tensor] = []
    chunk_seq: list[int] = []
    chunk_pos: list[int] = []
    for seq in range(num_seqs):
        begin, end = bounds[seq], bounds[seq + 1]
        if initial_states is None:
            state = torch.zeros(num_heads, head_dim, state_size, dtype=torch.float32, device=x.device)
        else:
            state = initial_states[seq].float()
        pos = starts[seq]
        token = begin
        while token < end:
            length = min(chunk_size - pos % chunk_size, end - token)
            sl = slice(token, token + length)
            y_chunk, state = ssd_chunk_ref(
                x[sl].float(),
                dt_all[sl],
                A32,
                _expand_groups(B[sl].float(), num_heads),
                _expand_groups(C[sl].float(), num_heads),
                state,
            )
            y[sl] = y_chunk
            token += length
            pos += length
            if pos % keep_every == 0:
                chunk_states.append(state)
                chunk_seq.append(seq)
                chunk_pos.append(pos)
        final_states[seq] = state
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    empty = torch.empty(0, num_heads, head_dim, state_size, dtype=torch.float32, device=x.device)
    return SSDScanOutput(
        y=y.to(x.dtype),
        final_states=final_states,
        chunk_states=torch.stack(chunk_states) if chunk_states else empty,
        chunk_state_seq=torch.tensor(chunk_seq, dtype=torch.int64, device=x.device),
        chunk_state_pos=torch.tensor(chunk_pos, dtype=torch.int64, device=x.device),
    )
