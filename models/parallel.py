"""Tensor-parallel building blocks: the group handle, row-parallel linears (one all-reduce each), the
vocab-parallel embedding and lm_head, and the Mamba2 gated RMSNorm whose groups may span ranks.

The MoE block shards every expert's intermediate dim (each rank a column slice of every expert's up_proj and
the matching row slice of down_proj, the shared expert likewise, router and latent projections replicated):
its partial output is linear in the slices, so one all-reduce per block, as for the MLP. With expert
parallelism each rank holds whole experts instead (a contiguous 1/size of them) and zeroes the routing weight of
the others; the same all-reduce combines the ranks' experts.

Column-parallel layers need no class of their own: a rank's shard of q/k/v, up_proj or in_proj is a plain
`Linear` over its slice of the output rows (`models/tp_shard.py` slices the checkpoint). Hand-written rather
than taken from a training library (Megatron, DTensor) because the engine runs eager packed-token forwards
over its own kernels and needs only these four pieces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridserve.common.model_config import MoEConfig
from hybridserve.kernels import ops
from hybridserve.kernels.ops import AUTO_KERNELS, Kernels
from hybridserve.models.layers import Linear
from hybridserve.models.moe import MoE, TopkRouter


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group (`group` None: torch.distributed's default group);
    `expert_parallel`: MoE blocks hold whole experts, a 1/size subset each, instead of a slice of every one."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    expert_parallel: bool = False

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns the tensor."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor onto every rank, in place."""
        if self.size > 1:
            dist.broadcast(tensor, src=0, group=self.group)
        return tensor

    def gather_cat(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's [M, n] on rank 0, concatenated along the last dim ([M, size * n]); None on other ranks."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(tensor, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


def vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """(first id, rows) of this rank's vocab shard; every rank holds ceil(V / size) rows, the last padded."""
    rows = -(-vocab_size // tp.size)
    return tp.rank * rows, rows


class RowParallelLinear(Linear):
    """A linear over this rank's slice of the input features; the partial products are summed across the
    group (the block's one all-reduce), then the (unsharded) bias is added."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__(in_features, out_features, bias=bias, kernels=kernels)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in/size] -> [N, out]
        out = self.tp.all_reduce(self.project(x, None))
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding table; ids outside give zeros and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.start, rows = vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class VocabParallelLMHead(Linear):
    """This rank's rows of lm_head; `forward` gives the local logits [M, ceil(V / size)], `gathered_logits` the
    full fp32 logits on rank 0 (None on the others)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup, kernels: Kernels = AUTO_KERNELS) -> None:
        _, rows = vocab_shard(vocab_size, tp)
        super().__init__(hidden_size, rows, bias=False, kernels=kernels)
        self.tp = tp
        self.vocab_size = vocab_size

    def gathered_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [M, hidden] -> [M, V] fp32 on rank 0
        full = self.tp.gather_cat(self(hidden))
        return None if full is None else full[:, : self.vocab_size].float()


class ShardedGatedRMSNorm(nn.Module):
    """The Mamba2 gated RMSNorm over this rank's channels [offset, offset + local) of the intermediate size,
    normalised per global group of `group_size` channels. When the groups fall inside the shard it is the
    local kernel; when a group spans ranks (TP above n_groups) each rank's per-group sums of squares are
    all-reduced first, so the result equals the unsharded norm."""

    def __init__(self, local_size: int, offset: int, group_size: int, num_groups: int, eps: float,
                 tp: TPGroup, kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_size), requires_grad=False)
        self.tp = tp
        self.kernels = kernels
        self.eps = eps
        self.group_size = group_size
        self.num_groups = num_groups
        self.offset = offset
        self.local = local_size % group_size == 0 and offset % group_size == 0

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [N, local] x2 -> [N, local]
        if self.local:
            return ops.gated_rmsnorm(x, gate, self.weight, group_size=self.group_size, eps=self.eps,
                                     kernels=self.kernels)
        gated = x.float() * F.silu(gate.float())
        sums = gated.new_zeros(gated.shape[0], self.num_groups)  # [N, G] this rank's part of each group
        channels = torch.arange(self.offset, self.offset + gated.shape[-1], device=gated.device)
        group = channels // self.group_size  # [local] global group of each channel
        sums.index_add_(1, group, gated.pow(2))
        self.tp.all_reduce(sums)
        rstd = torch.rsqrt(sums / self.group_size + self.eps)  # [N, G]
        return (self.weight.float() * gated * rstd[:, group]).to(x.dtype)


class TensorParallelMoE(MoE):
    """The MoE block over this rank's slice of every expert's (and the shared expert's) intermediate dim; the
    router and the latent projections are replicated. The partial sums of all ranks add up to the block's
    output (one all-reduce); the down projections' biases are loaded on rank 0 only (zeros elsewhere)."""

    def __init__(self, hidden_size: int, config: MoEConfig, bias: bool, tp: TPGroup,
                 kernels: Kernels = AUTO_KERNELS) -> None:
        super().__init__(hidden_size, config, bias, kernels)
        self.tp = tp

    def forward(self, x: torch.Tensor, small_max_pairs: int | None = None) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        return self.tp.all_reduce(super().forward(x, small_max_pairs))


class ExpertParallelMoE(MoE):
    """The MoE block over this rank's experts [rank * E/size, (rank + 1) * E/size), whole; the router is
    replicated, the shared expert split like an MLP, one all-reduce. The expert kernels cannot skip a pair and
    take a token at most once per expert, so each (token, choice) pair runs as its own row with one choice:
    pairs routed to other ranks get weight 0 on local expert 0, which a decode step reads anyway once any pair
    lands there (weight bytes read ~ the experts routed here + 1, as with TP slices), and the k rows of a token
    are summed in fp32. Sync-free, so a decode step still captures as a CUDA graph."""

    def __init__(self, hidden_size: int, config: MoEConfig, bias: bool, tp: TPGroup,
                 kernels: Kernels = AUTO_KERNELS) -> None:
        local_experts = config.num_experts // tp.size
        shared = config.shared_intermediate_size // tp.size
        super().__init__(hidden_size, dataclasses.replace(config, shared_intermediate_size=shared), bias, kernels)
        self.tp = tp
        self.first_expert = tp.rank * local_experts
        self.shared_chunks = 0  # routed experts are whole, the shared expert a slice: chunk sizes differ
        self.gate = TopkRouter(hidden_size, config, 0, kernels)
        experts = self.experts
        experts.up_proj = nn.Parameter(experts.up_proj[:local_experts], requires_grad=False)
        experts.down_proj = nn.Parameter(experts.down_proj[:local_experts], requires_grad=False)
        for name in ("up_proj_scale", "down_proj_scale"):  # fp8 per-channel scales, one row per expert
            scale = getattr(experts, name)
            if scale is not None:
                experts.register_buffer(name, scale[:local_experts])

    def local_routes(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global (weights, ids) [N, k] -> local ones: other ranks' experts get weight 0 on local expert 0."""
        local = ids - self.first_expert
        inside = (local >= 0) & (local < self.experts.up_proj.shape[0])  # [N, k]
        return weights.masked_fill(~inside, 0.0), local.masked_fill(~inside, 0)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, D], local routes [N, k] -> this rank's weighted sum of each token's experts [N, D] (fp32)."""
        n, k = ids.shape
        pairs = x.repeat_interleave(k, dim=0)  # [N * k, D]: one row per (token, choice)
        out = self.experts(pairs, weights.reshape(-1, 1), ids.reshape(-1, 1))  # [N * k, D]
        return out.view(n, k, -1).float().sum(dim=1)

    def forward(self, x: torch.Tensor, small_max_pairs: int | None = None) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        del small_max_pairs  # one row per (token, choice) here: the grouped path's shapes, whatever the count
        weights, ids = self.local_routes(*self.gate(x))
        if isinstance(self.fc1_latent_proj, nn.Identity):
            out = self.routed(x, weights, ids).to(x.dtype) + self.shared_experts(x)
        else:
            latent = self.fc1_latent_proj(x)
            out = self.fc2_latent_proj(self.routed(latent, weights, ids).to(latent.dtype)) + self.shared_experts(x)
        return self.tp.all_reduce(out)
