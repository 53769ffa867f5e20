"""The multi-token-prediction (MTP) drafter of NemotronH checkpoints (`mtp.layers.*`, one step).

Slot q of the drafter (q >= 1) combines token x_q with the target's final hidden state h_{q-1}:
  u_q = eh_proj([enorm(embed(x_q)), hnorm(h_{q-1})]);  u = u + mixer_i(norm_i(u)) for each MTP layer;
  g_q = final_layernorm(u)  ->  lm_head(g_q) predicts x_{q+1}.
Its attention layers keep their keys in the target's paged KV cache at the slot's own position q, so the KV
of slot q depends on x_0..x_q only (prefix-cacheable like the target's); slot 0 has no pair and is masked out
(`kv_start=1`). Drafting K tokens feeds g back as the next slot's hidden state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from hybridserve.common.model_config import ModelConfig
from hybridserve.kernels.ops import AUTO_KERNELS, Kernels
from hybridserve.models.attention import Attention
from hybridserve.models.forward_batch import ForwardBatch
from hybridserve.models.layers import MLP, Linear, RMSNorm, residual_stack
from hybridserve.models.moe import MoE

if TYPE_CHECKING:
    from hybridserve.statepool.state_cache import StateCache


class MTPLayer(nn.Module):
    """One MTP layer: the first holds the fusion projection, the last the final norm."""

    def __init__(self, config: ModelConfig, kind: str, first: bool, last: bool,
                 kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.kind = kind
        if first:
            self.enorm = RMSNorm(hidden, config.norm_eps, kernels)
            self.hnorm = RMSNorm(hidden, config.norm_eps, kernels)
            self.eh_proj = Linear(2 * hidden, hidden, bias=False, kernels=kernels)
        self.norm = RMSNorm(hidden, config.norm_eps, kernels)
        if kind == "attention":
            assert config.attention is not None  # ModelConfig validation guarantees it
            self.mixer: nn.Module = Attention(hidden, config.attention, kv_start=1, kernels=kernels)
        elif kind == "mlp":
            assert config.mlp_intermediate_size is not None
            self.mixer = MLP(hidden, config.mlp_intermediate_size, config.mlp_bias, kernels)
        else:
            assert config.moe is not None
            self.mixer = MoE(hidden, config.moe, config.mlp_bias, kernels)
        if last:
            self.final_layernorm = RMSNorm(hidden, config.norm_eps, kernels)


class MTPHead(nn.Module):
    """The drafter; embeddings and lm_head are the target's."""

    def __init__(self, config: ModelConfig, kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.config = config
        kinds = config.mtp_layer_types
        self.layers = nn.ModuleList(
            MTPLayer(config, kind, first=i == 0, last=i == len(kinds) - 1, kernels=kernels)
            for i, kind in enumerate(kinds)
        )

    def forward(
        self,
        token_embeds: torch.Tensor,  # [N, hidden] embeddings of x_q
        prev_hidden: torch.Tensor,  # [N, hidden] target (or drafter) hidden state h_{q-1}
        batch: ForwardBatch,  # the slots' positions, pages and sequence boundaries
        cache: StateCache,
    ) -> torch.Tensor:
        """-> g [N, hidden], the final-normed drafter state of every slot."""
        layers = [cast(MTPLayer, layer) for layer in self.layers]  # nn.ModuleList indexes as a plain Module
        first = layers[0]
        dtype = first.enorm.weight.dtype  # the model dtype (eh_proj may hold fp8 weights)
        fused = torch.cat([first.enorm(token_embeds.to(dtype)), first.hnorm(prev_hidden.to(dtype))], dim=-1)
        hidden = first.eh_proj(fused)
        residual_dtype = torch.float32 if self.config.residual_in_fp32 else hidden.dtype
        num_layers = self.config.num_layers

        def mix(i: int, normed: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
            layer = layers[i]
            if layer.kind == "attention":
                return layer.mixer(normed, batch, *cache.kv(num_layers + i))
            return layer.mixer(normed)

        # the norms' inputs are cast to each norm's weight dtype, which is enorm's: one model dtype
        norms = [layer.norm for layer in layers]
        return residual_stack(hidden, norms, layers[-1].final_layernorm, residual_dtype, mix)
