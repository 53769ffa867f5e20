"""Dense building blocks of the hybrid models: RMSNorm, the pre-norm residual stack, relu2 MLP (the mixture of
experts is `models/moe.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from hybridserve.kernels import ops
from hybridserve.kernels.ops import AUTO_KERNELS, Kernels


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict keys) whose forward goes through `ops.linear`, so decode-sized
    inputs on CUDA take the skinny Triton kernel; a projection with few output columns keeps the kernel's
    split-K scratch (made at its first call, i.e. in warm-up, before any CUDA-graph capture).

    `to_fp8` makes it an fp8 linear (a checkpoint that stores it so, models/fp8_dense.py): float8_e4m3fn
    `weight`, fp32 `weight_scale` [1] or [out] and, with static activation scaling, `input_scale` [1], buffers
    under the checkpoint's names; its forward is then `ops.fp8_linear`."""

    weight_scale: torch.Tensor | None
    input_scale: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernels = kernels
        self.register_buffer("weight_scale", None)  # None buffers stay out of the state dict
        self.register_buffer("input_scale", None)

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale is not None

    def to_fp8(self, per_channel: bool, static_input: bool) -> None:
        """Hold an fp8 weight from now on (called on the meta model, before the weights are filled in)."""
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty_like(self.weight, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale = torch.ones(self.out_features if per_channel else 1, device=device, dtype=torch.float32)
        self.input_scale = torch.ones(1, device=device, dtype=torch.float32) if static_input else None

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., in] -> [..., out]
        """x @ weight^T + bias (row-parallel subclasses pass no bias and add it after their all-reduce)."""
        if self.weight_scale is not None:
            return ops.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, bias, self.kernels)
        key = (self.weight.device, self.weight.shape[0])
        cached = self.__dict__.get("_split_k")
        if cached is None or cached[0] != key:  # None off CUDA and for projections with many output columns
            cached = (key, ops.split_k_workspace(self.weight, self.kernels))
            self.__dict__["_split_k"] = cached
        return ops.linear(x, self.weight, bias, cached[1], self.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class RMSNorm(nn.Module):
    """Plain RMSNorm (fp32 statistics)."""

    def __init__(self, size: int, eps: float, kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.weight = _param(size)
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(x, self.weight, self.eps, kernels=self.kernels)


def residual_stack(
    hidden: torch.Tensor,  # [N, hidden] the stream entering the first block
    norms: Sequence[RMSNorm],  # each block's pre-norm
    final_norm: RMSNorm,
    residual_dtype: torch.dtype,  # fp32 with residual_in_fp32, else the hidden dtype
    mixer: Callable[[int, torch.Tensor], torch.Tensor],  # (block index, normed [N, hidden]) -> [N, hidden]
) -> torch.Tensor:
    """x = x + mixer_i(norm_i(x)) per block, then final_norm(x) -> [N, hidden] in final_norm's dtype; each
    residual add runs fused with the norm after it (one kernel per block on CUDA, same math as unfused; the
    kernels the final norm was built with)."""
    chain = [*norms, final_norm]  # the norm before each block, then the final one
    residual = hidden.to(residual_dtype)
    normed = chain[0](hidden.to(chain[0].weight.dtype))
    for index, norm in enumerate(chain[1:]):
        normed, residual = ops.add_rmsnorm(mixer(index, normed), residual, norm.weight, norm.eps,
                                           kernels=final_norm.kernels)
    return normed


def relu2(x: torch.Tensor, inplace: bool = False, kernels: Kernels = AUTO_KERNELS) -> torch.Tensor:
    """Squared ReLU, NemotronH's MLP activation (one kernel on CUDA); `inplace` overwrites x (a fresh buffer)."""
    return ops.relu2(x, out=x if inplace else None, kernels=kernels)


class MLP(nn.Module):
    """Non-gated MLP: down(relu2(up(x)))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.kernels = kernels
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, kernels=kernels)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        return self.down_proj(relu2(self.up_proj(x), inplace=True, kernels=self.kernels))
