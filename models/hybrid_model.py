"""The hybrid causal LM (NemotronH and Mamba2): embeddings, pre-norm residual blocks, final norm, lm_head.

Parameter names follow transformers' checkpoints (without the `model.` / `backbone.` prefix), so a
checkpoint's state dict loads as it is.
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
from hybridserve.models.mamba_mixer import Mamba2Mixer
from hybridserve.models.moe import MoE
from hybridserve.models.mtp import MTPHead

if TYPE_CHECKING:  # the state cache depends on models.config; avoid the import cycle
    from hybridserve.statepool.state_cache import StateCache


class Block(nn.Module):
    """norm -> mixer -> residual add (`residual_stack` runs the add fused with the next block's norm)."""

    def __init__(self, config: ModelConfig, kind: str, index: int = 0, kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, kernels)
        if kind == "mamba":
            assert config.mamba is not None  # guaranteed by ModelConfig validation
            self.mixer: nn.Module = Mamba2Mixer(config.hidden_size, config.mamba, config.norm_eps, index, kernels)
        elif kind == "attention":
            assert config.attention is not None
            self.mixer = Attention(config.hidden_size, config.attention, kernels=kernels)
        elif kind == "mlp":
            assert config.mlp_intermediate_size is not None
            self.mixer = MLP(config.hidden_size, config.mlp_intermediate_size, config.mlp_bias, kernels)
        else:
            assert config.moe is not None
            self.mixer = MoE(config.hidden_size, config.moe, config.mlp_bias, kernels)


class HybridLM(nn.Module):
    """Forward over packed tokens of many sequences; state lives in a `StateCache`. `kernels` (the engine's
    kernel mode) is handed to every layer that calls an op."""

    def __init__(self, config: ModelConfig, kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, kind, i, kernels) for i, kind in enumerate(config.layer_types))
        self.norm_f = RMSNorm(config.hidden_size, config.norm_eps, kernels)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, kernels=kernels)
        self.mtp = MTPHead(config, kernels) if config.has_mtp else None
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: StateCache) -> torch.Tensor:
        """input_ids: [N] packed new tokens -> final-normed hidden states [N, hidden]."""
        hidden = self.embeddings(input_ids)
        residual_dtype = torch.float32 if self.config.residual_in_fp32 else hidden.dtype

        def mix(index: int, normed: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
            block = cast(Block, self.layers[index])  # nn.ModuleList indexes as a plain Module
            if block.kind == "mamba":
                replay = cache.replay_cache(index) if batch.spec_rollback == "replay" else None
                out = block.mixer(normed, batch, *cache.mamba(index), replay)
            elif block.kind == "attention":
                out = block.mixer(normed, batch, *cache.kv(index))
            else:
                out = block.mixer(normed)
            if batch.layer_done is not None:
                batch.layer_done(index)
            return out

        return residual_stack(hidden, [cast(Block, block).norm for block in self.layers], self.norm_f, residual_dtype, mix)

    @torch.inference_mode()
    def mtp_forward(
        self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, batch: ForwardBatch, cache: StateCache
    ) -> torch.Tensor:
        """The MTP drafter over slots (input_ids [N] = x_q, prev_hidden [N, hidden] = h_{q-1}) -> g [N, hidden]."""
        if self.mtp is None:
            raise ValueError("this checkpoint has no MTP module (no `mtp.*` weights / num_nextn_predict_layers)")
        return self.mtp(self.embeddings(input_ids), prev_hidden, batch, cache)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> fp32 logits [M, vocab]."""
        return self.lm_head(hidden).float()
