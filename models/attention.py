"""GQA self-attention without positional embedding (NemotronH), over the paged KV cache."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridserve.common.model_config import AttentionConfig
from hybridserve.kernels import ops
from hybridserve.kernels.ops import AUTO_KERNELS, Kernels
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.layers import Linear


class Attention(nn.Module):
    """q/k/v projections (one launch: see `_qkv`), KV written to pages, causal attention over each sequence's
    pages, o_proj."""

    def __init__(self, hidden_size: int, config: AttentionConfig, kv_start: int = 0,
                 kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.kv_start = kv_start  # keys before this position are never attended (1 for the MTP drafter)
        self.scale = config.head_dim**-0.5
        self.q_proj = Linear(hidden_size, config.num_heads * config.head_dim, bias=config.bias, kernels=kernels)
        self.k_proj = Linear(hidden_size, config.num_kv_heads * config.head_dim, bias=config.bias, kernels=kernels)
        self.v_proj = Linear(hidden_size, config.num_kv_heads * config.head_dim, bias=config.bias, kernels=kernels)
        self.o_proj = Linear(config.num_heads * config.head_dim, hidden_size, bias=config.bias, kernels=kernels)
        # fp8 KV pages hold key / k_scale and value / v_scale; 1.0 as vLLM uses without calibrated scales
        # (half-precision pages ignore them)
        self.k_scale = 1.0
        self.v_scale = 1.0

    def _qkv(self) -> tuple[torch.Tensor, torch.Tensor | None, Any, tuple[torch.Tensor, torch.Tensor | None] | None]:
        """q/k/v's weights as one [Nq + 2 Nkv, hidden] tensor (and biases as one [Nq + 2 Nkv]), plus its split-K
        scratch: a decode step reads the three in one launch instead of three (30B-A3B's k/v projections are too
        small for the skinny kernel and cost two cuBLAS kernels each). The three parameters become views of it,
        so there is no second copy and a checkpoint load writes through them; made again when a parameter was
        replaced (.to(), assigning loads). fp8 projections (all three or none, models/fp8_dense.py) add their
        scales: per output row [Nq + 2 Nkv], and the largest of their static input scales."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        cached = self.__dict__.get("_qkv_fused")
        if cached is not None and _views_of(cached[0], [p.weight for p in projs]) and (
                cached[1] is None or _views_of(cached[1], [p.bias for p in projs])):
            return cached
        weight = _fuse([p.weight for p in projs])
        bias = _fuse([p.bias for p in projs]) if self.q_proj.bias is not None else None
        scales = None
        if self.q_proj.weight_scale is not None:
            rows = torch.cat([p.weight_scale.float().expand(p.out_features) for p in projs if p.weight_scale is not None])
            statics = [p.input_scale for p in projs if p.input_scale is not None]
            scales = (rows, torch.stack(statics).amax().reshape(1) if statics else None)
        cached = (weight, bias, ops.split_k_workspace(weight, self.kernels) if scales is None else None, scales)
        self.__dict__["_qkv_fused"] = cached  # outside the parameters: state_dict keys stay checkpoint names
        return cached

    def forward(
        self,
        hidden: torch.Tensor,  # [N, hidden]
        batch: ForwardBatch,
        k_pages: torch.Tensor,  # [num_pages, page_size, Hkv, Dh]
        v_pages: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.config
        tokens = hidden.shape[0]
        weight, bias, workspace, scales = self._qkv()
        if scales is None:
            qkv = ops.linear(hidden, weight, bias, workspace, self.kernels)  # [N, Nq + 2 Nkv]
        else:
            qkv = ops.fp8_linear(hidden, weight, scales[0], scales[1], bias, self.kernels)
        kv_size = cfg.num_kv_heads * cfg.head_dim
        # strided views of qkv: write_kv and paged_attention take any strides
        q, k, v = qkv.split([cfg.num_heads * cfg.head_dim, kv_size, kv_size], dim=-1)
        q = q.view(tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        ops.write_kv(k, v, k_pages, v_pages, batch.slot_mapping, self.k_scale, self.v_scale, kernels=self.kernels)
        out = ops.paged_attention(
            q, k_pages, v_pages, batch.cu_seqlens, batch.kv_lens, batch.block_tables, self.scale,
            max_query_len=max(batch.query_lens, default=0), kv_start=self.kv_start, blocks=batch.attention_blocks(),
            k_scale=self.k_scale, v_scale=self.v_scale, kernels=self.kernels,
        )
        return self.o_proj(out.reshape(tokens, -1))


def _views_of(fused: torch.Tensor, params: list[torch.Tensor]) -> bool:
    """Whether params are still, in order, the consecutive row blocks of fused."""
    row_bytes = fused.stride(0) * fused.element_size()  # fused is torch.cat's contiguous output
    offset = 0  # rows of fused before this parameter
    for param in params:
        if (param.dtype != fused.dtype or param.device != fused.device or param.shape[1:] != fused.shape[1:]
                or param.data_ptr() != fused.data_ptr() + offset * row_bytes):
            return False
        offset += param.shape[0]
    return offset == fused.shape[0]


def _fuse(params: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate params along dim 0 into one tensor and point each parameter at its block of it."""
    with torch.inference_mode(False):  # a normal tensor even when first called in an inference-mode forward, so
        fused = torch.cat([p.detach() for p in params])  # a later load can still copy_ into the parameters
    offset = 0
    for param in params:
        param.data = fused[offset:offset + param.shape[0]]
        offset += param.shape[0]
    return fused
