"""NemotronH mixture of experts: the sigmoid group-limited top-k router, routed relu2 experts (optionally in a
latent space, bf16 or fp8 weights) and a shared expert. Sync-free (no `.tolist()` / `.item()` / `unique`), so
a decode step with MoE layers captures as a CUDA graph; the layer runs through `ops.moe_layer` (on CUDA the
Triton small-M path at decode sizes and the grouped GEMMs above; the batched torch reference elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.common.model_config import MoEConfig
from hybridserve.kernels import ops
from hybridserve.kernels.moe import RouterSpec, uses_fp8_activations
from hybridserve.kernels.ops import AUTO_KERNELS, Kernels
from hybridserve.models.layers import MLP, Linear


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class TopkRouter(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k choice, weights from the uncorrected scores."""

    def __init__(self, hidden_size: int, config: MoEConfig, num_shared: int = 0,
                 kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.kernels = kernels
        self.spec = RouterSpec(config.num_experts, config.experts_per_token, config.n_group, config.topk_group,
                               config.norm_topk_prob, config.routed_scaling_factor, num_shared)
        self.weight = _param(config.num_experts, hidden_size)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> (expert weights [N, k + num_shared] fp32, expert ids [N, k + num_shared])."""
        return ops.moe_route(x, self.weight, self.e_score_correction_bias, self.spec, kernels=self.kernels)


class Experts(nn.Module):
    """The routed experts as transformers stores them: up_proj [E, I, D], down_proj [E, D, I] (D = hidden or
    latent size); with fp8 weights also up_proj_scale [E, I] and down_proj_scale [E, D] (fp32 per channel)."""

    def __init__(self, config: MoEConfig, expert_in: int, kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.kernels = kernels
        self.fp8_activations = config.fp8_activations  # fp8 experts: W8A8 grouped GEMMs (kernels.moe)
        dtype = torch.float8_e4m3fn if config.fp8_experts else None
        self.up_proj = _param(config.num_experts, config.intermediate_size, expert_in, dtype=dtype)
        self.down_proj = _param(config.num_experts, expert_in, config.intermediate_size, dtype=dtype)
        scales = config.fp8_experts  # None buffers stay out of the state dict
        self.register_buffer("up_proj_scale", torch.ones(config.num_experts, config.intermediate_size) if scales else None)
        self.register_buffer("down_proj_scale", torch.ones(config.num_experts, expert_in) if scales else None)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared_out: torch.Tensor | None = None,
        shared: MLP | None = None,
    ) -> torch.Tensor:
        """x [N, D], routing weights / ids [N, k] -> the weighted sum of each token's experts [N, D]
        (+ shared_out [N, D], added in the same kernel; or the `shared` expert's chunks, ids E.., run with the
        routed experts)."""
        shared_up = shared.up_proj.weight if shared is not None else None
        shared_down = shared.down_proj.weight if shared is not None else None
        a8 = uses_fp8_activations(self.fp8_activations, self.up_proj, ids.numel())
        return ops.moe_experts(x, self.up_proj, self.down_proj, weights, ids, self.up_proj_scale,
                               self.down_proj_scale, shared_out, shared_up, shared_down, fp8_activations=a8,
                               kernels=self.kernels)


class MoE(nn.Module):
    """Routed relu2 experts (optionally in a latent space) plus a shared expert."""

    def __init__(self, hidden_size: int, config: MoEConfig, bias: bool, kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.kernels = kernels
        expert_in = config.latent_size or hidden_size
        # the shared expert as expert-sized chunks inside the fused GEMMs: same input space (no latent), same
        # dtype (not fp8), no biases, a whole number of chunks (Nano: 3712 = 2 x 1856)
        chunks, rest = divmod(config.shared_intermediate_size, config.intermediate_size)
        self.shared_chunks = chunks if (config.latent_size is None and not config.fp8_experts and not bias
                                        and rest == 0) else 0
        self.gate = TopkRouter(hidden_size, config, self.shared_chunks, kernels)
        self.experts = Experts(config, expert_in, kernels)
        self.shared_experts = MLP(hidden_size, config.shared_intermediate_size, bias, kernels)
        self.fc1_latent_proj: nn.Module = nn.Identity()
        self.fc2_latent_proj: nn.Module = nn.Identity()
        if config.latent_size is not None:
            self.fc1_latent_proj = Linear(hidden_size, config.latent_size, bias=bias, kernels=kernels)
            self.fc2_latent_proj = Linear(config.latent_size, hidden_size, bias=bias, kernels=kernels)

    def forward(self, x: torch.Tensor, small_max_pairs: int | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, hidden] through `ops.moe_layer` (router + experts in a few launches);
        small_max_pairs overrides the Triton path's small-M threshold (benchmarks compare both paths)."""
        gate, experts = self.gate, self.experts
        args = (gate.weight, gate.e_score_correction_bias, gate.spec, experts.up_proj, experts.down_proj,
                experts.up_proj_scale, experts.down_proj_scale)
        if self.shared_chunks:  # one pass: routed and shared experts in the same GEMMs
            shared = self.shared_experts
            return ops.moe_layer(x, *args, shared_up=shared.up_proj.weight, shared_down=shared.down_proj.weight,
                                 small_max_pairs=small_max_pairs, kernels=self.kernels)
        a8 = experts.fp8_activations
        if isinstance(self.fc1_latent_proj, nn.Identity):  # the shared expert's add fused into the combine
            return ops.moe_layer(x, *args, shared_out=self.shared_experts(x), small_max_pairs=small_max_pairs,
                                 fp8_activations=a8, kernels=self.kernels)
        routed = ops.moe_layer(x, *args, expert_x=self.fc1_latent_proj(x), small_max_pairs=small_max_pairs,
                               fp8_activations=a8, kernels=self.kernels)
        return self.fc2_latent_proj(routed) + self.shared_experts(x)
