"""GQA self-attention without positional embedding (NemotronH), over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.kernels import ops
from hybridserve.models.config import AttentionConfig
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.layers import Linear


class Attention(nn.Module):
    """q/k/v projections, KV written to pages, causal attention over each sequence's pages, o_proj."""

    def __init__(self, hidden_size: int, config: AttentionConfig, kv_start: int = 0) -> None:
        super().__init__()
        self.config = config
        self.kv_start = kv_start  # keys before this position are never attended (1 for the MTP drafter)
        self.scale = config.head_dim**-0.5
        self.q_proj = Linear(hidden_size, config.num_heads * config.head_dim, bias=config.bias)
        self.k_proj = Linear(hidden_size, config.num_kv_heads * config.head_dim, bias=config.bias)
        self.v_proj = Linear(hidden_size, config.num_kv_heads * config.head_dim, bias=config.bias)
        self.o_proj = Linear(config.num_heads * config.head_dim, hidden_size, bias=config.bias)

    def forward(
        self,
        hidden: torch.Tensor,  # [N, hidden]
        batch: ForwardBatch,
        k_pages: torch.Tensor,  # [num_pages, page_size, Hkv, Dh]
        v_pages: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.config
        tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(tokens, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(hidden).view(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(hidden).view(tokens, cfg.num_kv_heads, cfg.head_dim)
        ops.write_kv(k, v, k_pages, v_pages, batch.slot_mapping)
        out = ops.paged_attention(
            q, k_pages, v_pages, batch.cu_seqlens, batch.kv_lens, batch.block_tables, self.scale,
            max_query_len=max(batch.query_lens, default=0), kv_start=self.kv_start, blocks=batch.attention_blocks(),
        )
        return self.o_proj(out.reshape(tokens, -1))
