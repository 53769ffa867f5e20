"""Triton skinny linear for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows (M <= 16).

At batch 1 a decode step is a chain of weight reads, so each projection should stream W at copy bandwidth.
cuBLAS picks split-K kernels for the tall-K projections (mamba out_proj, MLP down) and adds a reduce kernel per
call; here one program owns BLOCK_N output columns and streams its [BLOCK_N, K] slice of W once through a
software-pipelined loop, with the x rows padded to the 16 a tl.dot needs (the padding costs no bytes).
The reference is `torch.nn.functional.linear`; `kernels.ops.linear` picks this kernel for few-row CUDA inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.triton_utils import (
    PERSIST_AUTOTUNE,
    cdiv,
    interpreting,
    last_to_arrive,
    pdl_gate,
    pdl_launch,
    prefetch_l2,
)

MAX_ROWS = 16  # rows of x this kernel takes (one tl.dot tile); more rows go to cuBLAS
MAX_SPLIT = 8  # most K-splits of a projection with few output columns (see SplitKWorkspace)


@dataclass(frozen=True)
class SplitKWorkspace:
    """Scratch for split-K launches of one projection. A projection with few output columns (a Mamba out_proj
    of 2688 columns: 168 programs of 16) leaves SMs idle; splitting K gives each column block SPLIT_K programs,
    each storing its fp32 partial sums; the last to arrive adds them in split order (deterministic, unlike
    atomics) and writes y, then resets its arrival count to 0, so the scratch is ready for the next call (and
    for CUDA-graph replays) without a memset kernel. Owned by the layer that calls the kernel (one per weight),
    never shared by two launches in flight."""

    partials: torch.Tensor  # [MAX_SPLIT, MAX_ROWS, N] fp32
    arrivals: torch.Tensor  # [cdiv(N, 16)] int32, all 0 between calls

    @classmethod
    def create(cls, out_features: int, device: torch.device) -> SplitKWorkspace:
        return cls(torch.empty(MAX_SPLIT, MAX_ROWS, out_features, dtype=torch.float32, device=device),
                   torch.zeros(cdiv(out_features, 16), dtype=torch.int32, device=device))


def wants_split(out_features: int, device: torch.device) -> bool:
    """Whether a projection has too few 16-column blocks to fill the device (two per SM): only those get a
    SplitKWorkspace, so the autotuner may split their K."""
    if device.type != "cuda":
        return False
    return cdiv(out_features, 16) < 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _configs(split: bool) -> list[triton.Config]:
    """Autotune space on the GPU (K-splits only with a workspace); one small config under the interpreter."""
    splits = (1, 2, 4, MAX_SPLIT) if split else (1,)
    if interpreting():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": splits[-1]}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk}, num_warps=w, num_stages=s)
            for n in (16, 32, 64) for k in (128, 256, 512) for w in (4, 8) for s in (3, 4) for sk in splits
            if n * k <= 16384]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """Keep a K-split only where the unsplit grid underfills the device and each split still streams at least
    four K blocks (more programs than 4 per SM only add partial-sum traffic)."""
    n, k = named_args["N"], named_args["K"]
    sms = torch.cuda.get_device_properties(named_args["w_ptr"].device).multi_processor_count
    kept = []
    for c in configs:
        blocks, split = cdiv(n, c.kwargs["BLOCK_N"]), c.kwargs["SPLIT_K"]
        if split == 1 or (blocks < 2 * sms and blocks * split <= 4 * sms and k >= 4 * split * c.kwargs["BLOCK_K"]):
            kept.append(c)
    return kept


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, arrive_ptr, M, N, K, x_m, w_n, y_m,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (n, s): acc[16, BLOCK_N] += x[16, BLOCK_K] @ W[BLOCK_N, BLOCK_K]^T over K-split s; with
    SPLIT_K > 1 the partials meet in part_ptr and the last program of column block n writes y."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_n
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # each split's K range, whole blocks
    k_start = tl.program_id(1) * k_len
    if USE_PDL:  # the first 1024 columns of this program's weight rows head for L2 while the kernel before
        # (which wrote x) finishes: one pointer per 128-byte line, clamped inside the weight
        lines = tl.minimum(k_start + tl.arange(0, 16) * 64, K - 1)
        rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * w_n
        prefetch_l2(rows + lines[None, :])
    pdl_gate(USE_PDL)
    for k0 in range(k_start, tl.minimum(k_start + k_len, K), BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        xk = tl.load(x_ptr + offs_m[:, None] * x_m + k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)  # [16, BLOCK_K]
        wk = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(xk, tl.trans(wk), acc, input_precision=DOT_PRECISION)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        tile = offs_m[:, None] * N + offs_n[None, :]  # this block's place in one split's [16, N] partials
        tl.store(part_ptr + tl.program_id(1) * 16 * N + tile, acc, mask=mask)
        if last_to_arrive(arrive_ptr + pid_n, SPLIT_K):
            acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # split order, not arrival order: the same sum every call
                acc += tl.load(part_ptr + s * 16 * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + offs_m[:, None] * y_m + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(arrive_ptr + pid_n, 0)  # ready for the next call
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * y_m + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


_KEY = ["N", "K", "HAS_BIAS"]
_skinny_plain = lean_launch(triton.autotune(configs=_configs(split=False), key=_KEY, cache_results=PERSIST_AUTOTUNE)(
    _skinny_linear_kernel))
_skinny_split = lean_launch(triton.autotune(configs=_configs(split=True), key=_KEY, cache_results=PERSIST_AUTOTUNE,
                                            prune_configs_by=None if interpreting() else {"early_config_prune": _prune})(
    _skinny_linear_kernel))


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: torch's linear."""
    return torch.nn.functional.linear(x, weight, bias)


def skinny_linear_triton(
    x: torch.Tensor,  # [..., K], at most MAX_ROWS rows in all
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None = None,  # [N]
    workspace: SplitKWorkspace | None = None,  # lets the autotuner split K (few output columns)
) -> torch.Tensor:
    """x @ weight^T + bias in x's dtype (fp32 accumulation), [..., N]."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match weight {tuple(weight.shape)} (want [N, K])")
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_linear_triton takes at most {MAX_ROWS} rows, got {rows}: use F.linear")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}: cast one of them")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    out_features, in_features = weight.shape
    x2 = x.reshape(rows, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if workspace is not None and (workspace.partials.shape[2] != out_features
                                  or workspace.partials.device != weight.device):
        raise ValueError(f"split-K workspace is for {workspace.partials.shape[2]} columns on "
                         f"{workspace.partials.device}, the weight has {out_features} on {weight.device}")
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows and out_features:
        def grid(meta: dict) -> tuple[int, int]:
            return (cdiv(out_features, meta["BLOCK_N"]), meta["SPLIT_K"])

        kernel = _skinny_split if workspace is not None else _skinny_plain
        pdl = pdl_launch(x.device)
        scratch = (workspace.partials, workspace.arrivals) if workspace is not None else (y, y)
        kernel[grid](
            x2, weight, bias if bias is not None else weight, y, *scratch, rows, out_features, in_features,
            x2.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32: exact parity runs
            **pdl,
        )
    return y.view(*x.shape[:-1], out_features)
