"""Triton skinny linear for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows (M <= 16).

At batch 1 a decode step is a chain of weight reads, so each projection should stream W at copy bandwidth.
cuBLAS picks split-K kernels for the tall-K projections (mamba out_proj, MLP down) and adds a reduce kernel per
call; here one program owns BLOCK_N output columns and streams its [BLOCK_N, K] slice of W once through a
software-pipelined loop, with the x rows padded to the 16 a tl.dot needs (the padding costs no bytes).
The reference is `torch.nn.functional.linear`; `kernels.ops.linear` picks this kernel for few-row CUDA inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.triton_utils import PERSIST_AUTOTUNE, interpreting

MAX_ROWS = 16  # rows of x this kernel takes (one tl.dot tile); more rows go to cuBLAS


def _configs() -> list[triton.Config]:
    """Autotune space on the GPU; one small config under the interpreter (tests)."""
    if interpreting():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for n in (16, 32, 64) for k in (128, 256, 512) for w in (4, 8) for s in (3, 4)
            if n * k <= 16384]


@triton.autotune(configs=_configs(), key=["N", "K", "HAS_BIAS"], cache_results=PERSIST_AUTOTUNE)
@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, x_m, w_n, y_m,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per BLOCK_N output columns: acc[16, BLOCK_N] += x[16, BLOCK_K] @ W[BLOCK_N, BLOCK_K]^T."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_n
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        xk = tl.load(x_ptr + offs_m[:, None] * x_m + k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)  # [16, BLOCK_K]
        wk = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(xk, tl.trans(wk), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * y_m + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: torch's linear."""
    return torch.nn.functional.linear(x, weight, bias)


def skinny_linear_triton(
    x: torch.Tensor,  # [..., K], at most MAX_ROWS rows in all
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None = None,  # [N]
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
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows and out_features:
        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(out_features, meta["BLOCK_N"]),)

        _skinny_linear_kernel[grid](
            x2, weight, bias if bias is not None else weight, y, rows, out_features, in_features,
            x2.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32: exact parity runs
        )
    return y.view(*x.shape[:-1], out_features)
