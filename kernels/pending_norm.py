"""A pre-norm block's input whose residual add and RMSNorm have not run yet.

Between two pre-norm blocks the step used to run one `add_rmsnorm` launch (s = residual + out, rmsnorm(s)).
At a decode batch of one that launch is pure latency: ~2.6 us each, 52 of them in a 30B-A3B step
(bench/results/h200/session50). Handing the next block a `PendingNorm` instead lets its first kernels compute the
add and the norm while they read their input (the skinny projection, the small MoE path's router and up kernels);
any other consumer calls `ops.normed`, which runs the same `add_rmsnorm` as before (same bits).

Contract: whichever consumer runs first writes `residual + out` into `residual_out` (the next block's residual),
exactly as `add_rmsnorm_ref` rounds it; `residual_out` aliases neither input, so programs still reading
`residual` never see it overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.kernels.gated_rmsnorm import add_rmsnorm_ref


@dataclass(frozen=True)
class PendingNorm:
    """out + residual, RMS-normalised with weight: the input of the next block, not computed yet."""

    out: torch.Tensor  # [N, D] the previous block's output (the model dtype)
    residual: torch.Tensor  # [N, D] the residual stream before the add (fp32 with residual_in_fp32)
    weight: torch.Tensor  # [D] this block's norm weight
    eps: float
    residual_out: torch.Tensor  # [N, D] residual's dtype: receives residual + out

    @classmethod
    def after(cls, out: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> PendingNorm:
        """The input of the block whose norm is (weight, eps), after a block that returned `out`."""
        return cls(out, residual, weight, eps, torch.empty_like(residual))

    @property
    def rows(self) -> int:
        return self.out.shape[0]

    def rows_contiguous(self) -> bool:
        """Whether out, residual and residual_out have unit-stride rows (what the fusing kernels read)."""
        return all(t.stride(-1) == 1 for t in (self.out, self.residual, self.residual_out))


def pending_norm_ref(pending: PendingNorm) -> torch.Tensor:
    """The reference: rmsnorm(residual + out) in the weight's dtype; fills residual_out."""
    normed, _ = add_rmsnorm_ref(pending.out, pending.residual, pending.weight, pending.eps,
                                residual_out=pending.residual_out)
    return normed


BlockInput = torch.Tensor | PendingNorm  # what a block's mixer takes: its normed input, or the pending one
