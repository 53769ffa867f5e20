"""Mamba2 mixer over packed tokens: in_proj -> causal conv1d + SiLU -> SSD scan -> gated RMSNorm -> out_proj.

Decode rows (one new token, state from earlier steps) take the recurrent update; prefill rows take the
chunked scan, starting from the slot's state when the sequence was resumed after a cached prefix. When the
batch asks for checkpoints, the conv windows and scan states at state_block boundaries (the scan's chunk
ends land on absolute multiples of chunk_size) are written to the checkpoint rows of the same pools.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.common.model_config import MambaConfig
from hybridserve.kernels import ops
from hybridserve.kernels.ops import AUTO_KERNELS, Kernels
from hybridserve.kernels.replay_state_update import ReplayCache
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.layers import Linear


class _Conv1dWeights(nn.Module):
    """Holds the depthwise conv weights under transformers' names (`conv1d.weight` [D, 1, K], `conv1d.bias`)."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


class _GatedNormWeights(nn.Module):
    """The gated RMSNorm (`norm.weight`), normalised per group of `group_size` channels (a tensor-parallel
    shard swaps in models/parallel.py's ShardedGatedRMSNorm, same call)."""

    def __init__(self, size: int, group_size: int, eps: float, kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.group_size = group_size
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [N, I] x2 -> [N, I]
        return ops.gated_rmsnorm(x, gate, self.weight, group_size=self.group_size, eps=self.eps, kernels=self.kernels)


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer; its conv window and SSM state live in the pools passed to `forward`."""

    def __init__(self, hidden_size: int, config: MambaConfig, norm_eps: float, layer_index: int = 0,
                 kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.norm_eps = norm_eps
        self.layer_index = layer_index  # key of this layer's states in ForwardBatch.intermediate_states
        self.in_proj = Linear(hidden_size, config.in_proj_size, bias=config.proj_bias, kernels=kernels)
        self.conv1d = _Conv1dWeights(config.conv_dim, config.conv_kernel, config.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(config.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(config.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(config.num_heads), requires_grad=False)
        self.norm = _GatedNormWeights(config.intermediate_size, config.intermediate_size // config.n_groups, norm_eps,
                                      kernels)
        self.out_proj = Linear(config.intermediate_size, hidden_size, bias=config.proj_bias, kernels=kernels)
        self._A: tuple[tuple[int, int], torch.Tensor] | None = None  # ((A_log storage, version), -exp(A_log))

    def decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log) [H] fp32, computed once per loaded A_log (keyed on its storage and version counter,
        so a reload recomputes it) instead of two elementwise kernels per layer in every step."""
        try:
            key = (self.A_log.data_ptr(), self.A_log._version)
        except RuntimeError:  # an inference tensor has no version counter: nothing to key a cache on
            return -torch.exp(self.A_log.float())
        if self._A is None or self._A[0] != key:
            with torch.no_grad():
                self._A = (key, -torch.exp(self.A_log.float()))
        return self._A[1]

    def forward(
        self,
        hidden: torch.Tensor,  # [N, hidden]
        batch: ForwardBatch,
        conv_pool: torch.Tensor,  # [num_slots, conv_dim, W]
        ssm_pool: torch.Tensor,  # [num_slots, H, P, N_state]
        replay: ReplayCache | None = None,  # this layer's replay inputs (spec_rollback == "replay")
    ) -> torch.Tensor:
        cfg = self.config
        heads, head_dim, state = cfg.num_heads, cfg.head_dim, cfg.state_size
        groups_state = cfg.n_groups * state
        projected = self.in_proj(hidden)
        gate, xBC, dt = projected.split([cfg.intermediate_size, cfg.conv_dim, heads], dim=-1)
        conv_weight = self.conv1d.weight[:, 0, :]  # [D, K]
        A = self.decay_rates()
        nd = batch.num_decode
        if nd and nd == batch.num_seqs:  # decode rows only: the recurrent path's output is y (no copy into a buffer)
            y_decode = self._decode(xBC, dt, A, batch, conv_pool, ssm_pool, replay)
            return self.out_proj(self.norm(y_decode.reshape(-1, cfg.intermediate_size), gate))
        y: torch.Tensor | None = None  # [N, H, P]; prefill rows only: the scan's output itself (no copy)
        if nd:
            y = torch.empty(hidden.shape[0], heads, head_dim, dtype=hidden.dtype, device=hidden.device)
            y[: nd * batch.decode_len] = self._decode(xBC, dt, A, batch, conv_pool, ssm_pool, replay)
        if nd < batch.num_seqs:
            xBC, dt = xBC[nd * batch.decode_len :], dt[nd * batch.decode_len :]
            slots, starts = batch.prefill_rows()
            boundary_rows = batch.boundary_rows  # None: no checkpoint is kept in this batch
            block = batch.state_block if boundary_rows is not None else None
            conv = ops.causal_conv1d_varlen(  # windows read from / written to the conv pool by the kernel
                xBC, conv_weight, self.conv1d.bias, batch.prefill_cu_seqlens(),
                start_positions=starts, state_block=block, conv_pool=conv_pool, slots=slots,
                boundary_rows=boundary_rows, meta=batch.prefill_conv_meta(block), kernels=self.kernels,
            )
            conv_out = conv.y
            tokens = conv_out.shape[0]
            x, B, C = conv_out.split([cfg.intermediate_size, groups_state, groups_state], dim=-1)
            scan = ops.ssd_scan_varlen(
                x.reshape(tokens, heads, head_dim),
                dt,
                A,
                B.reshape(tokens, cfg.n_groups, state),
                C.reshape(tokens, cfg.n_groups, state),
                batch.prefill_cu_seqlens(),
                cfg.chunk_size,
                D=self.D,
                dt_bias=self.dt_bias,
                dt_limit=cfg.dt_limit,
                start_positions=starts,
                state_block=block,
                state_pool=ssm_pool,  # resumed rows start from their slot; final and kept states go to the pool
                slots=slots,
                checkpoint_rows=boundary_rows,
                meta=batch.prefill_chunk_meta(cfg.chunk_size, block),
                init_rows=batch.prefill_init_rows(),
                kernels=self.kernels,
            )
            if y is None:
                y = scan.y
            else:
                y[nd * batch.decode_len :] = scan.y
        if y is None:  # a batch without rows
            y = torch.empty(0, heads, head_dim, dtype=hidden.dtype, device=hidden.device)
        return self.out_proj(self.norm(y.reshape(-1, cfg.intermediate_size), gate))

    def _decode(
        self,
        xBC: torch.Tensor,  # [N, conv_dim] (the decode rows come first)
        dt: torch.Tensor,  # [N, H]
        A: torch.Tensor,  # [H]
        batch: ForwardBatch,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        replay: ReplayCache | None,
    ) -> torch.Tensor:
        """The recurrent path of the decode rows: T = decode_len tokens each -> y [num_decode * T, H, P]."""
        cfg = self.config
        nd, tokens = batch.num_decode, batch.decode_len
        groups_state = cfg.n_groups * cfg.state_size
        slots = batch.state_slots[:nd]
        rows = nd * tokens
        conv_weight = self.conv1d.weight[:, 0, :]  # [D, K]
        conv_out = ops.causal_conv1d_update(xBC[:rows].view(nd, tokens, -1), conv_pool, slots, conv_weight,
                                            self.conv1d.bias, kernels=self.kernels)  # [nd, T, conv_dim]
        x, B, C = conv_out.split([cfg.intermediate_size, groups_state, groups_state], dim=-1)
        args = (
            x.reshape(nd, tokens, cfg.num_heads, cfg.head_dim), dt[:rows].view(nd, tokens, -1), A,
            B.reshape(nd, tokens, cfg.n_groups, cfg.state_size), C.reshape(nd, tokens, cfg.n_groups, cfg.state_size),
        )
        kwargs = dict(D=self.D, dt_bias=self.dt_bias, dt_limit=cfg.dt_limit, kernels=self.kernels)
        if batch.spec_rollback is None:
            y = ops.multi_token_state_update(ssm_pool, slots, *args, **kwargs)
        elif batch.spec_rollback == "intermediate":
            states = torch.empty((nd, tokens, *ssm_pool.shape[1:]), dtype=ssm_pool.dtype, device=ssm_pool.device)
            y = ops.multi_token_state_update(ssm_pool, slots, *args, intermediate_states=states,
                                             write_final_state=False, **kwargs)
            batch.intermediate_states[self.layer_index] = states
        else:
            if replay is None or batch.num_replay is None:
                raise RuntimeError("a replay verify step needs the layer's ReplayCache and num_replay")
            y = ops.replay_state_update(ssm_pool, replay, slots, batch.num_replay, *args, **kwargs)
        return y.reshape(rows, cfg.num_heads, cfg.head_dim)

