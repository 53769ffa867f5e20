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
    split-K scratch (made at its first call, i.e. in warm-up, before any CUDA-graph capture)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = (self.weight.device, self.weight.shape[0])
        cached = self.__dict__.get("_split_k")
        if cached is None or cached[0] != key:  # None off CUDA and for projections with many output columns
            cached = (key, ops.split_k_workspace(self.weight, self.kernels))
            self.__dict__["_split_k"] = cached
        return ops.linear(x, self.weight, self.bias, cached[1], self.kernels)


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
