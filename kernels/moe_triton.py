"""Triton fused MoE: one alignment kernel and one grouped GEMM launched twice (up with relu2, down with the routing
weight), then a sum over each token's k pair rows. No host sync and fixed launch sizes for a given token count,
so a decode step with MoE layers captures as a CUDA graph.

Alignment (`_moe_align_kernel`, one program): histogram of the pairs' experts, each expert padded to BLOCK_M
rows, prefix sums give its first row; every pair then takes the next row of its expert with an atomic add on a
per-expert cursor (the order inside an expert is arbitrary, which changes nothing: GEMM rows are independent).
The GEMM (`_moe_gemm_kernel`) runs one program per (block of BLOCK_M aligned rows, BLOCK_N output columns):
the block's rows gather their inputs by pair index, the block's expert streams its weight tile, fp8 weights
are cast to the activation dtype in registers (weight-only fp8) or, with fp8 inputs (W8A8: each GEMM's input rows
quantized per row first), multiplied fp8 x fp8; the row and per-channel scales multiply the fp32 accumulator;
blocks past the used rows exit at once.
The router kernels are in `moe_router_triton.py`, the torch references in `moe.py`; `kernels.ops.moe_experts`
dispatches.
"""

from __future__ import annotations

from typing import cast

import torch
import triton
import triton.language as tl

from hybridserve.kernels.fp8_linear_triton import quantize_activation_triton
from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.moe import align_capacity, check_fp8_activations
from hybridserve.kernels.triton_utils import PERSIST_AUTOTUNE, cdiv, dot_launch, interpreting, next_pow2


@lean_launch
@triton.jit
def _moe_align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, used_rows_ptr, cursor_ptr, num_pairs, num_rows, num_blocks,
    E: tl.constexpr, E_BINS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK_CHUNK: tl.constexpr,
):
    """Writes sorted_ptr [num_rows] (pair per row, num_pairs = padding), block_expert_ptr [num_blocks] and
    used_rows_ptr [1]; cursor_ptr [E_BINS] int32 is scratch."""
    bins = tl.arange(0, E_BINS)
    counts = tl.zeros([E_BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0).to(tl.int32)
        mask = (offs < num_pairs) & (ids >= 0) & (ids < E)  # an id out of range claims no row (never a stray write)
        counts += tl.histogram(ids, E_BINS, mask=mask)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + bins, ends - padded)
    tl.store(used_rows_ptr, tl.sum(padded, 0))
    for start in range(0, num_rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=offs < num_rows)
    for start in range(0, num_blocks, BLOCK_CHUNK):  # [BLOCK_CHUNK, E_BINS] compares: a small chunk
        blocks = start + tl.arange(0, BLOCK_CHUNK)
        first_row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), 1)  # experts ending before the row
        tl.store(block_expert_ptr + blocks, tl.minimum(expert, E - 1), mask=blocks < num_blocks)
    tl.debug_barrier()  # cursors and padding are written before any pair claims its row
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0).to(tl.int32)
        mask = (offs < num_pairs) & (ids >= 0) & (ids < E)
        row = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
        tl.store(sorted_ptr + row, offs, mask=mask)


def moe_align_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `moe_align_ref` (rows within one expert in any order)."""
    flat = topk_ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {flat.dtype}")
    flat = flat.contiguous()
    pairs = flat.numel()
    rows = align_capacity(pairs, num_experts, block_m)
    blocks = rows // block_m
    device = flat.device
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    used_rows = torch.empty(1, dtype=torch.int32, device=device)
    bins = next_pow2(num_experts)
    cursor = torch.empty(bins, dtype=torch.int32, device=device)
    chunk = 64 if interpreting() else 1024
    _moe_align_kernel[(1,)](flat, sorted_pairs, block_expert, used_rows, cursor, pairs, rows, blocks,
                            E=num_experts, E_BINS=bins, BLOCK_M=block_m, CHUNK=chunk,
                            BLOCK_CHUNK=max(1, 8192 // bins), num_warps=4)
    return sorted_pairs, block_expert, used_rows


# (BLOCK_N, BLOCK_K, warps, stages, GROUP_M): decode blocks (BLOCK_M <= 32) stream weight tiles; prefill blocks
# (BLOCK_M 64 / 128) are Hopper warpgroup-MMA tiles, 8 warps (two warpgroups) over 128 x 128 / 256 accumulators,
# 3-4 stages of cp.async, GROUP_M blocks of rows sharing each weight tile while it is in L2 (an expert's rows
# are adjacent blocks); kept to a few so the first call of each launch family compiles and tunes in seconds
_DECODE_TILES = [(n, k, 4, s, 1) for n in (32, 64) for k in (128, 256) for s in (3, 4)]
_PREFILL_TILES = {  # by BLOCK_M: 128 rows as two warpgroups (8 warps), 64 rows as one (4 warps) or two
    128: [(128, 64, 8, 3, 8), (128, 64, 8, 4, 8), (256, 64, 8, 3, 8), (128, 128, 8, 3, 8), (128, 64, 4, 4, 8),
          (128, 64, 8, 4, 1)],
    64: [(128, 64, 4, 4, 8), (256, 64, 4, 3, 8), (128, 128, 4, 3, 8), (256, 64, 8, 3, 8), (64, 64, 4, 4, 8)],
}
_FP8_PREFILL_TILES = {  # fp8 x fp8 (A_FP8): a K step of 128 bytes, as the bf16 tiles' 64 elements
    128: [(128, 128, 8, 3, 8), (128, 128, 8, 4, 8), (256, 128, 8, 3, 8), (128, 64, 8, 4, 8)],
    64: [(128, 128, 4, 4, 8), (256, 128, 4, 3, 8), (128, 128, 8, 3, 8), (128, 64, 4, 4, 8)],
}


def _gemm_configs() -> list[triton.Config]:
    """Autotune space on the GPU; one small config under the interpreter (tests)."""
    if interpreting():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g}, num_warps=w, num_stages=s)
            for n, k, w, s, g in sorted(set(_DECODE_TILES).union(*_PREFILL_TILES.values(),
                                                                *_FP8_PREFILL_TILES.values()))]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """The decode tiles for BLOCK_M <= 32, the prefill tiles of that BLOCK_M (and operand type) above."""
    block_m = kwargs.get("BLOCK_M", named_args.get("BLOCK_M", 16))
    block_m = block_m if isinstance(block_m, int) else 16
    prefill = _FP8_PREFILL_TILES if kwargs.get("A_FP8", named_args.get("A_FP8")) is True else _PREFILL_TILES
    tiles = set(_DECODE_TILES if block_m <= 32 else prefill[64 if block_m <= 64 else 128])
    kept = [c for c in configs
            if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages, c.kwargs["GROUP_M"]) in tiles]
    return kept or configs


@lean_launch
@triton.autotune(configs=_gemm_configs(), key=["N_OUT", "K", "BLOCK_M", "A_ROW_DIV", "HAS_SCALE", "SHARED", "A_FP8"],
                 prune_configs_by={"early_config_prune": _prune}, cache_results=PERSIST_AUTOTUNE)
@triton.jit
def _moe_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, ws_ptr, scale_ptr, out_ptr, sorted_ptr, block_expert_ptr, used_rows_ptr,
    num_pairs, num_routed, num_blocks, N_OUT, K, a_m, w_e, w_n, ws_e, ws_n, out_m,
    SHARED: tl.constexpr, A_ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, RELU2: tl.constexpr, HAS_SCALE: tl.constexpr, A_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """out[pair, n] = act(sum_k a[pair // A_ROW_DIV, k] * W[e, n, k] * scale[e, n]), rounded to out's dtype;
    with SHARED, experts e >= num_routed are chunks of the shared expert's weight at ws_ptr. With A_FP8, a is
    fp8 with a scale per row (a_scale_ptr) and the fp8 x fp8 products run on the fp8 tensor cores. One program
    per (row block, column tile), GROUP_M row blocks at a time walking the column tiles (the swizzle that keeps
    a group's gathered rows and each weight tile in L2)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N_OUT, BLOCK_N)
    group = pid // (GROUP_M * n_tiles)
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    in_group = pid % (GROUP_M * n_tiles)
    pid_m = first_m + in_group % group_rows
    pid_n = in_group // group_rows
    if pid_m * BLOCK_M >= tl.load(used_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pairs < num_pairs
    a_rows = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * a_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_OUT
    if SHARED:
        if expert >= num_routed:
            w_rows = ws_ptr + (expert - num_routed) * ws_e + offs_n.to(tl.int64)[:, None] * ws_n
        else:
            w_rows = w_ptr + expert * w_e + offs_n.to(tl.int64)[:, None] * w_n
    else:
        w_rows = w_ptr + expert * w_e + offs_n.to(tl.int64)[:, None] * w_n
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if not A_FP8:
            w = w.to(a.dtype)  # fp8 -> the activation dtype: exact
        if DOT_UPCAST:  # the interpreter's bf16 / fp8 dot is wrong; fp32 operands give the same exact products
            a, w = a.to(tl.float32), w.to(tl.float32)
        # fp8 x fp8 on sm_90: Triton lets the tensor cores accumulate all of K in their reduced precision; folding
        # each K step into fp32 cut the error from ~1e-3 to 1.6e-4 (W8A8 itself: 2.6e-2) for +32-35 % prefill GEMM
        # time (bench/results/h200/kernels/fp8_accumulation/), so the fast default stays
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if A_FP8:  # each row's activation scale, then (HAS_SCALE) each column's weight scale
        acc *= tl.load(a_scale_ptr + pairs // A_ROW_DIV, mask=row_ok, other=0.0)[:, None]
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * N_OUT + offs_n, mask=n_ok, other=0.0)[None, :]
    if RELU2:  # on the projection rounded to the output dtype, as relu2(linear(x)) computes it
        acc = tl.maximum(acc.to(out_ptr.dtype.element_ty).to(tl.float32), 0.0)
        acc = acc * acc
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * out_m + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@lean_launch
@triton.jit
def _moe_combine_kernel(pair_ptr, route_w_ptr, shared_ptr, out_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr,
                        HAS_SHARED: tl.constexpr):
    """out[t] = round(sum_j w[t, j] * pair_out[t * K + j]) (+ shared[t]): each pair's product already rounded to
    the activation dtype (half the bytes of fp32 pair rows, the same numbers: transformers' experts round it
    before the routing weight too), the fp32 sum rounded to the output dtype before the shared expert's add."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        pair = tl.load(pair_ptr + (row * K + j) * D + offs, mask=mask, other=0.0).to(tl.float32)
        acc += pair * tl.load(route_w_ptr + row * K + j)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_SHARED:
        out = (out.to(tl.float32) + tl.load(shared_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32))
    tl.store(out_ptr + row * D + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per aligned block from the mean pairs per expert, so that one block holds an expert's rows (two
    blocks read its weights twice): 16 (the smallest tl.dot tile) up to 12, 32 up to 24, 64 up to 64, 128 above.
    30B-A3B fp8 experts on H200 (bench/results/h200/decode_step/large_batch_block_m.json, large_batch_w8a8.json,
    ../prefill/moe_fp8_prefill.json): at 18 / 24 per expert 32 rows take 532 / 565 us against 764 / 929 us at 16;
    at 30 / 36 / 48, 64 rows 629 / 640 / 663 us against 700 / 868 / 1,018 at 32 (W8A8 at 48: 448 against 482
    at 128); at 96, 128 rows 996 / 564 us (weight-only / W8A8) against 1,223 / 628 at 64; at 12, 16 and 32 tie."""
    per_expert = num_pairs / num_experts
    if per_expert <= 12:
        return 16
    if per_expert <= 24:
        return 32
    return 64 if per_expert <= 64 else 128


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
    out: torch.Tensor, align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_pairs: int, a_row_div: int,
    block_m: int, relu2: bool, shared: tuple[torch.Tensor, int, int] | None = None,
    a_scale: torch.Tensor | None = None,
) -> None:
    """`shared`: (weight, chunk stride, row stride) of the shared expert's chunks, experts E, E+1, ...;
    `a_scale` [rows of a, 1] fp32, contiguous: a is fp8 with these per-row scales (quantize_activation_triton's;
    w fp8 too, as check_fp8_activations ensures)."""
    sorted_pairs, block_expert, used_rows = align
    n_out, k = w.shape[1], w.shape[2]
    ws, ws_e, ws_n = shared if shared is not None else (w, 0, 0)

    num_blocks = block_expert.numel()

    def grid(meta: dict) -> tuple[int]:
        return (num_blocks * cdiv(n_out, meta["BLOCK_N"]),)

    _moe_gemm_kernel[grid](
        a, a_scale if a_scale is not None else a, w, ws, scale if scale is not None else a, out,
        sorted_pairs, block_expert, used_rows, num_pairs, w.shape[0], num_blocks, n_out, k, a.stride(0), w.stride(0),
        w.stride(1), ws_e, ws_n, out.stride(0), SHARED=shared is not None, A_ROW_DIV=a_row_div, BLOCK_M=block_m,
        RELU2=relu2, HAS_SCALE=scale is not None, A_FP8=a_scale is not None,
        **dot_launch(a.dtype),
    )


def check_expert_inputs(
    x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, up_scale: torch.Tensor | None,
    shared_out: torch.Tensor | None, shared_up: torch.Tensor | None, shared_down: torch.Tensor | None,
) -> int:
    """ValueError naming what does not fit; -> the number of shared-expert chunks (0 without them)."""
    d = x.shape[1]
    num_experts, inter = w_up.shape[0], w_up.shape[1]
    chunks = 0
    if shared_up is not None and shared_down is not None:
        chunks = shared_up.shape[0] // inter
        if (chunks == 0 or shared_up.shape != (chunks * inter, d) or shared_down.shape != (d, chunks * inter)
                or shared_up.dtype != w_up.dtype or shared_down.dtype != w_down.dtype or up_scale is not None):
            raise ValueError(f"shared expert up {tuple(shared_up.shape)} / down {tuple(shared_down.shape)} must be "
                             f"whole [{inter}]-row chunks in the (unquantized) experts' dtype {w_up.dtype}")
    if w_up.shape[2] != d or w_down.shape != (num_experts, d, inter):
        raise ValueError(f"expert weights up {tuple(w_up.shape)} / down {tuple(w_down.shape)} do not fit x [.., {d}]")
    if (w_up.dtype == torch.float8_e4m3fn) != (up_scale is not None):
        raise ValueError("fp8 expert weights need their scales (and only fp8 weights take scales)")
    if shared_out is not None and (shared_out.shape != x.shape or shared_out.dtype != x.dtype):
        raise ValueError(f"shared_out must be {tuple(x.shape)} {x.dtype}, got {tuple(shared_out.shape)} {shared_out.dtype}")
    return chunks


def moe_experts_triton(
    x: torch.Tensor,  # [N, D]
    w_up: torch.Tensor,  # [E, I, D] (bf16 / fp16 / fp32, or float8_e4m3fn with up_scale)
    w_down: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [N, k] fp32
    topk_ids: torch.Tensor,  # [N, k]
    up_scale: torch.Tensor | None = None,  # [E, I] fp32
    down_scale: torch.Tensor | None = None,  # [E, D] fp32
    shared_out: torch.Tensor | None = None,  # [N, D] in x's dtype
    shared_up: torch.Tensor | None = None,  # [S * I, D] the shared expert's chunks: experts E .. E + S - 1
    shared_down: torch.Tensor | None = None,  # [D, S * I]
    block_m: int | None = None,  # rows per aligned block (16 / 32 / 64 / 128); default `choose_block_m`
    fp8_activations: bool = False,  # fp8 weights: quantize each GEMM's input rows to fp8 (W8A8)
) -> torch.Tensor:
    """Same contract as `moe_experts_ref`: [N, D] in x's dtype (sum, rounding and shared add in one kernel;
    shared chunks run in the grouped GEMMs with the routed experts). With fp8_activations the expert inputs
    and the relu2 rows are quantized per row (one Triton kernel each) and both GEMMs multiply fp8 x fp8."""
    n, d = x.shape
    num_experts, inter = w_up.shape[0], w_up.shape[1]
    chunks = check_expert_inputs(x, w_up, w_down, up_scale, shared_out, shared_up, shared_down)
    if chunks:
        shared_up, shared_down = cast(torch.Tensor, shared_up).contiguous(), cast(torch.Tensor, shared_down).contiguous()
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != n:
        raise ValueError(f"topk ids {tuple(topk_ids.shape)} and weights {tuple(topk_weights.shape)} must be [N, k]")
    k = topk_ids.shape[1]
    pairs = n * k
    if pairs == 0:
        return torch.zeros_like(x) if shared_out is None else shared_out.clone()
    x = x.contiguous()
    w_up = w_up if w_up.stride(-1) == 1 else w_up.contiguous()  # rows are read along K
    w_down = w_down if w_down.stride(-1) == 1 else w_down.contiguous()
    if block_m is None:
        block_m = choose_block_m(pairs, num_experts + chunks)
    elif block_m not in (16, 32, 64, 128):
        raise ValueError(f"block_m must be 16, 32, 64 or 128, got {block_m}")
    check_fp8_activations(fp8_activations, w_up, chunks)
    align = moe_align_triton(topk_ids, num_experts + chunks, block_m)
    hidden = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    up_shared = (cast(torch.Tensor, shared_up), inter * d, d) if chunks else None  # chunk c: rows c*I .. of [S*I, D]
    up_in, up_in_scale = quantize_activation_triton(x) if fp8_activations else (x, None)  # [N, D] fp8, [N, 1]
    _grouped_gemm(up_in, w_up, up_scale, hidden, align, pairs, k, block_m, relu2=True, shared=up_shared,
                  a_scale=up_in_scale)
    pair_out = torch.empty(pairs, d, dtype=x.dtype, device=x.device)  # each pair's rounded product
    down_shared = (cast(torch.Tensor, shared_down), inter, chunks * inter) if chunks else None  # columns c*I ..
    down_in, down_in_scale = quantize_activation_triton(hidden) if fp8_activations else (hidden, None)
    _grouped_gemm(down_in, w_down, down_scale, pair_out, align, pairs, 1, block_m, relu2=False, shared=down_shared,
                  a_scale=down_in_scale)
    out = torch.empty_like(x)
    shared = shared_out.contiguous() if shared_out is not None else out
    route_w = topk_weights.reshape(-1).float().contiguous()
    _moe_combine_kernel[(n, cdiv(d, 1024))](pair_out, route_w, shared, out, d, K=k, BLOCK_D=1024,
                                                   HAS_SHARED=shared_out is not None, num_warps=4)
    return out
