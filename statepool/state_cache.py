"""Device tensors holding every request's state, and how big they are.

Layout is request-major so one request's state is one contiguous block (cheap to copy, checkpoint and ship):
  k_pages / v_pages: [num_pages, n_attention_layers, page_size, Hkv, Dh]
  conv_states:       [num_slots + num_checkpoints, n_mamba_layers, conv_dim, conv_width]  (W >= conv_kernel-1)
  ssm_states:        [num_slots + num_checkpoints, n_mamba_layers, H, P, N]   (dtype `mamba_ssm_cache_dtype`)
  hidden_states:     [num_slots + num_checkpoints, hidden]  final hidden state of the last computed token
                     (models with an MTP drafter only: its next slot needs it, so checkpoints keep it too)
KV layers are the attention layers followed by the MTP drafter's attention layers (`ModelConfig.kv_layers`).
Rows [0, num_slots) are running requests' slots, the rest checkpoint slots of the prefix cache: one index
space, so prefill writes checkpoints through the same per-layer views and a hit is one row copy. A running
slot no request holds may hold a checkpoint too (`CheckpointAllocator`'s lender) until a request needs it.
Layers see strided per-layer views.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.kernels.replay_state import ReplayCache

logger = logging.getLogger(__name__)


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheLayout:
    """Sizes of the pools; `bytes_per_page` / `bytes_per_slot` drive sizing from a memory budget."""

    num_pages: int
    page_size: int
    num_slots: int
    conv_width: int
    num_checkpoints: int = 0

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.num_pages < 0 or self.num_slots <= 0 or self.num_checkpoints < 0:
            raise ValueError(f"invalid cache layout {self}")

    @staticmethod
    def kv_dtype(config: ModelConfig, dtype: torch.dtype) -> torch.dtype:
        """The KV pages' dtype: the model's `dtype`, or float8_e4m3fn under kv_cache_dtype "fp8"."""
        return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else dtype

    @staticmethod
    def bytes_per_page(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        attn = config.attention
        if attn is None:
            return 0
        per_token = 2 * attn.num_kv_heads * attn.head_dim * _dtype_size(CacheLayout.kv_dtype(config, dtype))
        return per_token * page_size * len(config.kv_layers())

    @staticmethod
    def bytes_per_slot(config: ModelConfig, conv_width: int, dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        m = config.mamba
        if m is None:
            return 0
        per_layer = m.conv_dim * conv_width * _dtype_size(dtype)
        per_layer += m.num_heads * m.head_dim * m.state_size * _dtype_size(ssm_dtype)
        hidden = config.hidden_size * _dtype_size(dtype) if config.has_mtp else 0
        return per_layer * len(config.layers_of("mamba")) + hidden


class StateCache:
    """Allocates the pools and maps a layer index to its per-layer view."""

    def __init__(
        self,
        config: ModelConfig,
        layout: CacheLayout,
        dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.layout = layout
        self._attention_index = {layer: i for i, layer in enumerate(config.kv_layers())}
        self._mamba_index = {layer: i for i, layer in enumerate(config.layers_of("mamba"))}
        attn, mamba = config.attention, config.mamba
        n_attn, n_mamba = len(self._attention_index), len(self._mamba_index)
        pages = layout.num_pages if n_attn else 0
        kv_shape = (pages, n_attn, layout.page_size, attn.num_kv_heads if attn else 0, attn.head_dim if attn else 0)
        kv_dtype = CacheLayout.kv_dtype(config, dtype)
        self.k_pages = torch.zeros(kv_shape, dtype=kv_dtype, device=device)
        self.v_pages = torch.zeros(kv_shape, dtype=kv_dtype, device=device)
        slots = layout.num_slots + layout.num_checkpoints if n_mamba else 0
        conv_dim = mamba.conv_dim if mamba else 0
        self.conv_states = torch.zeros((slots, n_mamba, conv_dim, layout.conv_width), dtype=dtype, device=device)
        ssm_shape = (slots, n_mamba, *((mamba.num_heads, mamba.head_dim, mamba.state_size) if mamba else (0, 0, 0)))
        self.ssm_states = torch.zeros(ssm_shape, dtype=ssm_dtype, device=device)
        self._replay: list[ReplayCache] = []
        hidden_rows = slots if config.has_mtp else 0
        self.hidden_states = torch.zeros((hidden_rows, config.hidden_size), dtype=dtype, device=device)

    def enable_replay(self, tokens: int) -> None:
        """Allocate the per-layer replay inputs of every running slot (speculative decoding, rollback "replay")."""
        mamba = self.config.mamba
        if mamba is None:
            return
        self._replay = [
            ReplayCache.allocate(self.layout.num_slots, tokens, mamba.num_heads, mamba.head_dim, mamba.n_groups,
                                 mamba.state_size, self.conv_states.dtype, self.conv_states.device)
            for _ in self._mamba_index
        ]

    def replay_cache(self, layer: int) -> ReplayCache:
        if not self._replay:
            raise RuntimeError("replay rollback was not enabled on this state cache")
        return self._replay[self._mamba_index[layer]]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer page views [num_pages, page_size, Hkv, Dh]."""
        i = self._attention_index[layer]
        return self.k_pages[:, i], self.v_pages[:, i]

    def mamba(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer slot views: conv [rows, conv_dim, W], ssm [rows, H, P, N] (rows: slots + checkpoints)."""
        i = self._mamba_index[layer]
        return self.conv_states[:, i], self.ssm_states[:, i]

    def mirror(self, op: str, *args: object) -> None:
        """Hook for state edits made outside the model (speculative snapshot / rollback): a tensor-parallel
        rank 0's cache sends them to the other ranks' shards (engine/tp_worker.py); nothing here."""

    def copy_state(self, source: int, target: int) -> None:
        """Copy one slot's conv window and SSM state (every Mamba layer) into another slot."""
        self.conv_states[target].copy_(self.conv_states[source])
        self.ssm_states[target].copy_(self.ssm_states[source])
        if self.hidden_states.shape[0]:
            self.hidden_states[target].copy_(self.hidden_states[source])

    def total_bytes(self) -> int:
        tensors = (self.k_pages, self.v_pages, self.conv_states, self.ssm_states, self.hidden_states)
        return sum(t.numel() * t.element_size() for t in tensors) + sum(r.nbytes() for r in self._replay)
