"""Dense building blocks of the hybrid models: RMSNorm, the pre-norm residual stack, relu2 MLP, NemotronH
mixture of experts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.kernels import ops
from hybridserve.models.config import MoEConfig


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict keys) whose forward goes through `ops.linear`, so decode-sized
    inputs on CUDA take the skinny Triton kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Plain RMSNorm (fp32 statistics)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(x, self.weight, self.eps)


def residual_stack(
    hidden: torch.Tensor,  # [N, hidden] the stream entering the first block
    norms: Sequence[RMSNorm],  # each block's pre-norm
    final_norm: RMSNorm,
    residual_dtype: torch.dtype,  # fp32 with residual_in_fp32, else the hidden dtype
    mixer: Callable[[int, torch.Tensor], torch.Tensor],  # (block index, normed [N, hidden]) -> [N, hidden]
) -> torch.Tensor:
    """x = x + mixer_i(norm_i(x)) per block, then final_norm(x) -> [N, hidden] in final_norm's dtype; each
    residual add runs fused with the norm after it (one kernel per block on CUDA, same math as unfused)."""
    chain = [*norms, final_norm]  # the norm before each block, then the final one
    residual = hidden.to(residual_dtype)
    normed = chain[0](hidden.to(chain[0].weight.dtype))
    for index, norm in enumerate(chain[1:]):
        normed, residual = ops.add_rmsnorm(mixer(index, normed), residual, norm.weight, norm.eps)
    return normed


def relu2(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Squared ReLU, NemotronH's MLP activation (one kernel on CUDA); `inplace` overwrites x (a fresh buffer)."""
    return ops.relu2(x, out=x if inplace else None)


class MLP(nn.Module):
    """Non-gated MLP: down(relu2(up(x)))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        return self.down_proj(relu2(self.up_proj(x), inplace=True))


class TopkRouter(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k choice, weights from the uncorrected scores."""

    def __init__(self, hidden_size: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = _param(config.num_experts, hidden_size)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> (expert weights [N, k], expert ids [N, k])."""
        cfg = self.config
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()
        per_group = cfg.num_experts // cfg.n_group
        group_scores = choice.view(-1, cfg.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        top_groups = group_scores.topk(cfg.topk_group, dim=-1)[1]  # [N, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand(-1, -1, per_group).reshape(-1, cfg.num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(cfg.experts_per_token, dim=-1)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed relu2 experts (optionally in a latent space) plus a shared expert."""

    def __init__(self, hidden_size: int, config: MoEConfig, bias: bool) -> None:
        super().__init__()
        expert_in = config.latent_size or hidden_size
        self.gate = TopkRouter(hidden_size, config)
        self.experts = nn.Module()
        self.experts.up_proj = _param(config.num_experts, config.intermediate_size, expert_in)
        self.experts.down_proj = _param(config.num_experts, expert_in, config.intermediate_size)
        self.shared_experts = MLP(hidden_size, config.shared_intermediate_size, bias)
        self.fc1_latent_proj: nn.Module = nn.Identity()
        self.fc2_latent_proj: nn.Module = nn.Identity()
        if config.latent_size is not None:
            self.fc1_latent_proj = Linear(hidden_size, config.latent_size, bias=bias)
            self.fc2_latent_proj = Linear(config.latent_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        weights, ids = self.gate(x)
        latent = self.fc1_latent_proj(x)
        routed = torch.zeros(latent.shape, dtype=torch.float32, device=x.device)
        for expert in ids.unique().tolist():
            token_idx, rank = torch.where(ids == expert)
            h = relu2(F.linear(latent[token_idx], self.experts.up_proj[expert]), inplace=True)
            h = F.linear(h, self.experts.down_proj[expert])
            routed.index_add_(0, token_idx, (h * weights[token_idx, rank, None]).float())
        return self.fc2_latent_proj(routed.to(x.dtype)) + self.shared_experts(x)
