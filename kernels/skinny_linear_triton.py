"""Triton skinny linear for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows (M <= 16).

At batch 1 a decode step is a chain of weight reads, so each projection should stream W at copy bandwidth.
cuBLAS picks split-K kernels for the tall-K projections (mamba out_proj, MLP down) and adds a reduce kernel per
call; here one program owns BLOCK_N output columns and streams its [BLOCK_N, K] slice of W once through a
software-pipelined loop, with the x rows padded to the 16 a tl.dot needs (the padding costs no bytes).
The reference is `torch.nn.functional.linear`; `kernels.ops.linear` picks this kernel for few-row CUDA inputs.
With a gate the same kernel first applies the Mamba mixer's gated RMSNorm to x (`gated_norm_linear_triton`: the
norm's output never goes through memory and its launch is gone); the reference is then `gated_norm_linear_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridserve.kernels.gated_rmsnorm import gated_rmsnorm_ref
from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.triton_utils import (
    PERSIST_AUTOTUNE,
    cdiv,
    interpreting,
    next_pow2,
    pdl_gate,
    pdl_launch,
    prefetch_l2,
)

MAX_ROWS = 16  # rows of x this kernel takes (one tl.dot tile); more rows go to cuBLAS
MAX_SPLIT = 8  # most K-splits of a projection with few output columns (see SplitKWorkspace)


def norm_fits(channels: int, group_size: int) -> bool:
    """Whether the fused norm takes these groups: each config's K block lies in one group, so the group size is a
    multiple of the smallest BLOCK_K of the config space (32 under the interpreter, 128 on the GPU)."""
    align = 32 if interpreting() else 128
    return group_size > 0 and channels % group_size == 0 and group_size % align == 0


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
        if kwargs.get("NORM") and named_args["group_size"] % c.kwargs["BLOCK_K"]:
            continue  # a normed K block must lie in one norm group
        if split == 1 or (blocks < 2 * sms and blocks * split <= 4 * sms and k >= 4 * split * c.kwargs["BLOCK_K"]):
            kept.append(c)
    return kept


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, arrive_ptr, z_ptr, nw_ptr, M, N, K, x_m, w_n, y_m, z_m, group_size,
    eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, GROUPS: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (n, s): acc[16, BLOCK_N] += x[16, BLOCK_K] @ W[BLOCK_N, BLOCK_K]^T over K-split s; with
    SPLIT_K > 1 the partials meet in part_ptr and the last program of column block n writes y. With NORM, x is
    first replaced by nw * g / rms(g) per group of `group_size` channels, g = x * silu(z) (GROUPS: the groups of
    K, rounded up to a power of two): a first pass sums g^2 over every group the split touches (whole groups, so
    the split's blocks see their group's full statistics), the main loop normalises each block (one group per
    block: group_size is a multiple of BLOCK_K) and rounds it to x's dtype, as the unfused norm stores it."""
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
    k_end = tl.minimum(k_start + k_len, K)
    offs_g = tl.arange(0, GROUPS)
    rstd_all = tl.zeros([16, GROUPS], dtype=tl.float32)
    if NORM:  # per row and group: 1 / rms(g) over the whole groups this split's range touches
        squares = tl.zeros([16, GROUPS], dtype=tl.float32)
        first, last = (k_start // group_size) * group_size, tl.minimum(tl.cdiv(k_end, group_size) * group_size, K)
        for k0 in range(first, last, BLOCK_K):
            g = _gated_block(x_ptr, z_ptr, offs_m, k0 + offs_k, mask_m, K, x_m, z_m)
            squares += tl.where(offs_g[None, :] == k0 // group_size, tl.sum(g * g, axis=1)[:, None], 0.0)
        rstd_all = 1.0 / tl.sqrt(squares / group_size + eps)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        if NORM:
            g = _gated_block(x_ptr, z_ptr, offs_m, k, mask_m, K, x_m, z_m)
            rstd = tl.sum(tl.where(offs_g[None, :] == k0 // group_size, rstd_all, 0.0), axis=1)  # [16]
            nw = tl.load(nw_ptr + k, mask=mask_k, other=0.0).to(tl.float32)
            xk = (nw[None, :] * (g * rstd[:, None])).to(x_ptr.dtype.element_ty)  # [16, BLOCK_K]
        else:
            xk = tl.load(x_ptr + offs_m[:, None] * x_m + k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                         other=0.0)  # [16, BLOCK_K]
        wk = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(xk, tl.trans(wk), acc, input_precision=DOT_PRECISION)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        tile = offs_m[:, None] * N + offs_n[None, :]  # this block's place in one split's [16, N] partials
        tl.store(part_ptr + tl.program_id(1) * 16 * N + tile, acc, mask=mask)
        # acq_rel: the partial stores above are visible before the count; the last arrival sees all of them
        if tl.atomic_add(arrive_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
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


@triton.jit
def _gated_block(x_ptr, z_ptr, offs_m, k, mask_m, K, x_m, z_m):
    """g = x * silu(z) of one [16, BLOCK_K] block, fp32 (zero where masked)."""
    mask = mask_m[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * x_m + k[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs_m[:, None] * z_m + k[None, :], mask=mask, other=0.0).to(tl.float32)
    return x * z * tl.sigmoid(z)


_KEY = ["N", "K", "HAS_BIAS", "NORM", "GROUPS", "group_size"]
_skinny_plain = lean_launch(triton.autotune(configs=_configs(split=False), key=_KEY, cache_results=PERSIST_AUTOTUNE,
                                            prune_configs_by=None if interpreting() else {"early_config_prune": _prune})(
    _skinny_linear_kernel))
_skinny_split = lean_launch(triton.autotune(configs=_configs(split=True), key=_KEY, cache_results=PERSIST_AUTOTUNE,
                                            prune_configs_by=None if interpreting() else {"early_config_prune": _prune})(
    _skinny_linear_kernel))


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: torch's linear."""
    return torch.nn.functional.linear(x, weight, bias)


def gated_norm_linear_ref(
    x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, group_size: int, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle of the fused path: the gated RMSNorm (rounded to x's dtype), then torch's linear."""
    return torch.nn.functional.linear(gated_rmsnorm_ref(x, z, norm_weight, group_size, eps), weight, bias)


def skinny_linear_triton(
    x: torch.Tensor,  # [..., K], at most MAX_ROWS rows in all
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None = None,  # [N]
    workspace: SplitKWorkspace | None = None,  # lets the autotuner split K (few output columns)
) -> torch.Tensor:
    """x @ weight^T + bias in x's dtype (fp32 accumulation), [..., N]."""
    return _launch(x, weight, bias, workspace, None)


def gated_norm_linear_triton(
    x: torch.Tensor,  # [..., K] the Mamba mixer's scan output, at most MAX_ROWS rows in all
    z: torch.Tensor,  # [..., K] its gate
    norm_weight: torch.Tensor,  # [K]
    group_size: int,  # channels per norm group (see norm_fits)
    eps: float,
    weight: torch.Tensor,  # [N, K] out_proj, rows contiguous
    bias: torch.Tensor | None = None,  # [N]
    workspace: SplitKWorkspace | None = None,
) -> torch.Tensor:
    """`gated_norm_linear_ref` in one launch: linear(gated_rmsnorm(x, z), weight, bias), [..., N] in x's dtype."""
    if z.shape != x.shape:
        raise ValueError(f"gate shape {tuple(z.shape)} != x shape {tuple(x.shape)}")
    if norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm weight must be [{x.shape[-1]}], got {tuple(norm_weight.shape)}")
    if not norm_fits(x.shape[-1], group_size):
        raise ValueError(f"group_size {group_size} must divide the {x.shape[-1]} channels and be a multiple of the "
                         "kernel's K block (norm_fits): use gated_rmsnorm, then linear")
    return _launch(x, weight, bias, workspace, (z, norm_weight, group_size, eps))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, workspace: SplitKWorkspace | None,
            norm: tuple[torch.Tensor, torch.Tensor, int, float] | None) -> torch.Tensor:
    """Checks and the launch of both entry points (norm: gate, norm weight, group size, eps)."""
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
    x2 = _rows(x, rows)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if workspace is not None and (workspace.partials.shape[2] != out_features
                                  or workspace.partials.device != weight.device):
        raise ValueError(f"split-K workspace is for {workspace.partials.shape[2]} columns on "
                         f"{workspace.partials.device}, the weight has {out_features} on {weight.device}")
    z2, norm_weight, group_size, eps = (x2, weight, 1, 0.0) if norm is None else (_rows(norm[0], rows), *norm[1:])
    groups = 1 if norm is None else next_pow2(in_features // group_size)
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows and out_features:
        def grid(meta: dict) -> tuple[int, int]:
            return (cdiv(out_features, meta["BLOCK_N"]), meta["SPLIT_K"])

        kernel = _skinny_split if workspace is not None else _skinny_plain
        pdl = pdl_launch(x.device)
        scratch = (workspace.partials, workspace.arrivals) if workspace is not None else (y, y)
        kernel[grid](
            x2, weight, bias if bias is not None else weight, y, *scratch, z2, norm_weight, rows, out_features,
            in_features, x2.stride(0), weight.stride(0), y.stride(0), z2.stride(0), group_size, eps,
            HAS_BIAS=bias is not None, NORM=norm is not None, GROUPS=groups,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32: exact parity runs
            **pdl,
        )
    return y.view(*x.shape[:-1], out_features)


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, K] with unit stride along K (a view where it can be)."""
    t2 = t.reshape(rows, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
