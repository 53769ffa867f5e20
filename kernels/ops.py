"""The ops the model calls. Each picks the implementation for the tensors' device: the Triton kernel on
CUDA where one exists (and triton imports), the pure-torch reference otherwise (CPU, and the oracle in tests).
A `Kernels` value (the engine's `kernel_mode`, given to the model's layers when they are built and passed to
every op as `kernels=`) can force the references everywhere or run the Triton kernels on CPU tensors.

Model code imports from here only, so a new kernel is wired in by changing one function in this file.
Triton modules are imported on first CUDA use, so a CPU-only install never needs triton.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridserve.kernels.causal_conv1d import ConvVarlenMeta, causal_conv1d_update_ref, causal_conv1d_varlen_ref
from hybridserve.kernels.fp8_linear import fp8_linear_ref
from hybridserve.kernels.gated_rmsnorm import add_rmsnorm_ref, gated_rmsnorm_ref, relu2_ref, rmsnorm_ref
from hybridserve.kernels.moe import moe_experts_ref, moe_layer_ref, route_topk
from hybridserve.kernels.paged_attention import (
    PREFILL_BLOCK_M,
    QueryBlocks,
    paged_attention_ref,
    query_block_lists,
    write_kv_pages,
)
from hybridserve.kernels.replay_state_update import advance_states, replay_state_update_ref
from hybridserve.kernels.sampling import SEED_BITS, gumbel_sample_ref, pack_rows
from hybridserve.kernels.ssd_scan import NO_DT_LIMIT, DtLimit, ssd_scan_varlen_ref
from hybridserve.kernels.ssd_scan_meta import INT32_FIELDS, WHOLE_SEQUENCE, ChunkMeta, chunk_lists
from hybridserve.kernels.state_update import multi_token_state_update_ref

# auto: Triton on CUDA tensors, references elsewhere; reference: the torch references everywhere (debugging,
# A/B checks); interpret: the Triton kernels on CPU tensors too, under Triton's interpreter (TRITON_INTERPRET=1),
# so the whole engine can be checked against the references without a GPU (slow: tiny models only)
KERNEL_MODES = ("auto", "reference", "interpret")


@functools.cache
def triton_available() -> bool:
    """True when triton imports and a CUDA device is usable."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Kernels:
    """Which implementation the ops take (one of KERNEL_MODES): made once from the engine's config and held by
    every layer that calls an op, so a process can hold models of different modes and nothing global decides."""

    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in KERNEL_MODES:
            raise ValueError(f"kernel mode must be one of {', '.join(KERNEL_MODES)}, got {self.mode!r}")
        if self.mode == "interpret" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernel mode 'interpret' runs the Triton kernels on CPU tensors in Triton's interpreter: "
                             "set TRITON_INTERPRET=1 in the environment before the process starts")

    def triton_for(self, first: torch.Tensor) -> bool:
        """Whether an op with a Triton kernel runs it for these tensors (`first` is the op's first argument)."""
        if self.mode == "auto":
            return first.is_cuda and triton_available()
        return self.mode == "interpret"

    def cuda_triton(self, tensor: torch.Tensor) -> bool:
        """Whether a CUDA-only kernel (no interpreter path, e.g. the skinny linear) may run for this tensor."""
        return self.mode != "reference" and tensor.is_cuda and triton_available()


AUTO_KERNELS = Kernels()  # the default of layers built outside an engine (tests, benchmarks, tools)


@functools.cache
def _triton_fn(module: str, name: str) -> Any:
    """`name` (a launcher, or a constant such as a kernel's row limit) from a Triton kernel module."""
    return getattr(importlib.import_module(f"hybridserve.kernels.{module}"), name)


def _dispatch(reference: Callable[..., Any], module: str, name: str) -> Callable[..., Any]:
    """An op that calls `module.name` (Triton) where `kernels` says so (by default for CUDA tensors) and
    `reference` otherwise; `kernels` is a keyword of the op, not passed on."""

    @functools.wraps(reference)
    def op(first: torch.Tensor, *args: Any, kernels: Kernels = AUTO_KERNELS, **kwargs: Any) -> Any:
        if kernels.triton_for(first):
            return _triton_fn(module, name)(first, *args, **kwargs)
        return reference(first, *args, **kwargs)

    return op


# inside a decode step (weights cold in L2, bench/kernels/step_profile.py) the skinny kernel with split-K matches or beats
# cuBLAS + its split-K reduce down to 4M-element projections (Nemotron-3-Nano-30B-A3B's 11M-element out_proj /
# q_proj / o_proj, bench/results/h200/decode_step/); attention's k/v projections are too small alone and ride
# in the fused q/k/v weight (models/attention.py)
SKINNY_MIN_WEIGHT = 4 * 1024 * 1024  # weight elements


def skinny_linear_applies(x: torch.Tensor, weight: torch.Tensor, kernels: Kernels = AUTO_KERNELS) -> bool:
    """Whether `linear` takes the skinny Triton kernel for these tensors."""
    return (kernels.cuda_triton(x) and weight.numel() >= SKINNY_MIN_WEIGHT and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.numel() <= _triton_fn("skinny_linear_triton", "MAX_ROWS") * x.shape[-1])


def split_k_workspace(weight: torch.Tensor, kernels: Kernels = AUTO_KERNELS) -> Any:
    """A SplitKWorkspace for a CUDA weight with few output columns (the skinny kernel may then split K), or
    None; the caller keeps it for the weight's lifetime and never uses it in two launches at once."""
    if not kernels.cuda_triton(weight) or not _triton_fn("skinny_linear_triton", "wants_split")(
            weight.shape[0], weight.device):
        return None
    return _triton_fn("skinny_linear_triton", "SplitKWorkspace").create(weight.shape[0], weight.device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           workspace: Any = None, kernels: Kernels = AUTO_KERNELS) -> torch.Tensor:
    """x @ weight^T + bias: the skinny Triton kernel for a decode step's few rows (up to its MAX_ROWS) against a
    large half-precision weight on CUDA (it streams the weight closer to copy bandwidth than cuBLAS), torch's
    linear otherwise. `workspace` (from split_k_workspace) lets the kernel split K over more programs."""
    if skinny_linear_applies(x, weight, kernels):
        return _triton_fn("skinny_linear_triton", "skinny_linear_triton")(x, weight, bias, workspace)
    return torch.nn.functional.linear(x, weight, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               kernels: Kernels = AUTO_KERNELS) -> torch.Tensor:
    """x @ (fp8 weight * weight_scale)^T + bias with x quantized to fp8 (static input_scale, else per token): on a
    GPU with fp8 tensor cores one Triton quantization kernel + torch._scaled_mm, the torch reference otherwise."""
    if kernels.triton_for(x) and _triton_fn(
            "fp8_linear_triton", "scaled_mm_applies")(x, weight):
        return _triton_fn("fp8_linear_triton", "fp8_linear_triton")(x, weight, weight_scale, input_scale, bias)
    return fp8_linear_ref(x, weight, weight_scale, input_scale, bias)


ssd_scan_varlen = _dispatch(ssd_scan_varlen_ref, "ssd_scan_triton", "ssd_scan_varlen_triton")
causal_conv1d_varlen = _dispatch(causal_conv1d_varlen_ref, "causal_conv1d_triton", "causal_conv1d_varlen_triton")
causal_conv1d_update = _dispatch(causal_conv1d_update_ref, "causal_conv1d_triton", "causal_conv1d_update_triton")
multi_token_state_update = _dispatch(
    multi_token_state_update_ref, "state_update_triton", "multi_token_state_update_triton"
)


def selective_state_update(
    state_pool: torch.Tensor,  # [num_slots, H, P, N]
    slots: torch.Tensor,  # [B]
    x: torch.Tensor,  # [B, H, P]
    dt: torch.Tensor,  # [B, H] raw
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [B, G, N]
    C: torch.Tensor,  # [B, G, N]
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: DtLimit = NO_DT_LIMIT,
    z: torch.Tensor | None = None,  # [B, H, P]
    kernels: Kernels = AUTO_KERNELS,
) -> torch.Tensor:
    """One token per row (a decode step): `multi_token_state_update` with T = 1, on either path; y [B, H, P]."""
    return multi_token_state_update(
        state_pool, slots, x[:, None], dt[:, None], A, B[:, None], C[:, None], D=D, dt_bias=dt_bias,
        dt_softplus=dt_softplus, dt_limit=dt_limit, z=None if z is None else z[:, None], kernels=kernels,
    )[:, 0]


replay_state_update = _dispatch(replay_state_update_ref, "replay_state_update_triton", "replay_state_update_triton")
paged_attention = _dispatch(paged_attention_ref, "paged_attention_triton", "paged_attention_triton")
write_kv = _dispatch(write_kv_pages, "paged_attention_triton", "write_kv_pages_triton")
gated_rmsnorm = _dispatch(gated_rmsnorm_ref, "gated_rmsnorm_triton", "gated_rmsnorm_triton")
rmsnorm = _dispatch(rmsnorm_ref, "gated_rmsnorm_triton", "rmsnorm_triton")
add_rmsnorm = _dispatch(add_rmsnorm_ref, "gated_rmsnorm_triton", "add_rmsnorm_triton")
relu2 = _dispatch(relu2_ref, "gated_rmsnorm_triton", "relu2_triton")
# routed relu2 experts: alignment + two grouped GEMMs + sum over each token's k rows (sync-free either way)
moe_experts = _dispatch(moe_experts_ref, "moe_triton", "moe_experts_triton")
# NemotronH's router (sigmoid, group-limited top-k with the correction bias): fp32 logits + one choice kernel
moe_route = _dispatch(route_topk, "moe_router_triton", "route_topk_triton")
# router + experts (+ shared) of one MoE layer: three launches at decode sizes, the grouped GEMMs above
moe_layer = _dispatch(moe_layer_ref, "moe_small_triton", "moe_layer_triton")
# a token per row by Gumbel-max (greedy rows: argmax): two launches for the step's sampling tail
gumbel_sample = _dispatch(gumbel_sample_ref, "sampling_triton", "gumbel_sample_triton")

# the engine reaches kernels through this file only: beside the ops, the metadata types and host-side helpers
# its graph capture, sampler and speculative rollback use are exported from here
__all__ = [
    "AUTO_KERNELS",
    "ChunkMeta",
    "ConvVarlenMeta",
    "INT32_FIELDS",
    "KERNEL_MODES",
    "Kernels",
    "PREFILL_BLOCK_M",
    "QueryBlocks",
    "SEED_BITS",
    "WHOLE_SEQUENCE",
    "add_rmsnorm",
    "advance_states",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "chunk_lists",
    "fp8_linear",
    "gated_rmsnorm",
    "gumbel_sample",
    "linear",
    "moe_experts",
    "moe_layer",
    "moe_route",
    "multi_token_state_update",
    "pack_rows",
    "paged_attention",
    "query_block_lists",
    "relu2",
    "replay_state_update",
    "rmsnorm",
    "selective_state_update",
    "ssd_scan_varlen",
    "triton_available",
    "write_kv",
]
