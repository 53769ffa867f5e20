"""Stream-K skinny linear for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 16, as one wave of equal programs.

The tiled skinny kernel (skinny_linear_triton.py) gives each program one [BLOCK_N, K / SPLIT_K] slice: a 30B-A3B
out_proj is 336 programs of eight 8 KB tiles, 2.5 per SM, each spending most of its life filling and draining its
pipeline, and even with the weight in L2 it takes 1.5x its HBM floor (bench/results/h200/session49, call 2). Here
the (column block, K block) iterations are laid end to end (K fastest) and cut into PROGRAMS equal runs, a few per
SM: every SM streams the same bytes through one long pipeline. A column block whose iterations fall in one run is
written directly; one cut between runs has each run's partial sum stored in the program's own slot (first or last
column block of its run), and the last run to arrive adds them in run order (deterministic) and resets the arrival
count, so CUDA-graph replays need no memset. The reference is `torch.nn.functional.linear`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.triton_utils import PERSIST_AUTOTUNE, cdiv, interpreting, pdl_gate, prefetch_l2

MAX_ROWS = 16  # rows of x (one tl.dot tile)
MAX_BLOCK_N = 64  # widest column block of the autotune space (sizes a program's partial slots)
MAX_PER_SM = 4  # most programs per SM of the autotune space
INTERPRETER_PROGRAMS = 5  # programs under the interpreter (no SMs to count): runs cut inside column blocks


def wants_streamk(out_features: int, device: torch.device) -> bool:
    """Whether a projection gets a StreamKWorkspace (CUDA, at most 8 column blocks of 16 per program slot: the
    lm_head's 8192 blocks fill the device in even waves anyway); HYBRIDSERVE_SKINNY_STREAMK=0 turns it off."""
    if device.type != "cuda" or os.environ.get("HYBRIDSERVE_SKINNY_STREAMK", "1") == "0":
        return False
    return cdiv(out_features, 16) <= 2 * MAX_PER_SM * _sm_count(device)


def _sm_count(device: torch.device) -> int:
    return INTERPRETER_PROGRAMS if device.type != "cuda" else torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class StreamKWorkspace:
    """Scratch for one projection's stream-K launches: two partial-sum slots per program (the column blocks its
    run starts and ends in) and an arrival count per column block, 0 between calls. Owned by the layer that
    calls the kernel, never used by two launches in flight."""

    partials: torch.Tensor  # [max programs, 2, MAX_ROWS, MAX_BLOCK_N] fp32
    arrivals: torch.Tensor  # [cdiv(N, 16)] int32
    out_features: int

    @classmethod
    def create(cls, out_features: int, device: torch.device) -> StreamKWorkspace:
        programs = MAX_PER_SM * _sm_count(device) if device.type == "cuda" else INTERPRETER_PROGRAMS
        return cls(torch.empty(programs, 2, MAX_ROWS, MAX_BLOCK_N, dtype=torch.float32, device=device),
                   torch.zeros(cdiv(out_features, 16), dtype=torch.int32, device=device), out_features)


def _configs() -> list[triton.Config]:
    """Autotune space on the GPU; one small config under the interpreter (PER_SM is ignored there)."""
    if interpreting():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "PER_SM": 1}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "PER_SM": p}, num_warps=4, num_stages=s)
            for n in (16, 32, 64) for k in (128, 256) for p in (1, 2, MAX_PER_SM) for s in (3, 5)]


@triton.jit
def _run_start(p, iters, progs):
    """The first iteration of program p's run: runs are [p * iters // progs, (p + 1) * iters // progs), iters
    an int64 (the product can pass 2**31)."""
    return (p * iters // progs).to(tl.int32)


@triton.jit
def _run_owner(j, iters, progs):
    """The program whose run holds iteration j (iters int64)."""
    p = (j * progs // iters).to(tl.int32)
    if _run_start(p + 1, iters, progs) <= j:
        p += 1
    return p


@triton.jit
def _finish_block(tile, k_blocks, iters, progs, part_ptr, arrive_ptr, bias_ptr, y_ptr, M, N, y_m,
                  BLOCK_N: tl.constexpr, MAX_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Count this program's arrival at a column block cut between runs; the last to arrive adds every run's
    partial in run order, writes y and resets the count."""
    first = _run_owner(tile * k_blocks, iters, progs)
    last = _run_owner(tile * k_blocks + k_blocks - 1, iters, progs)
    # acq_rel: this program's partial stores are visible before its count; the last arrival sees all of them
    if tl.atomic_add(arrive_ptr + tile, 1, sem="acq_rel") == last - first:
        offs_m = tl.arange(0, 16)
        offs_bn = tl.arange(0, BLOCK_N)
        offs_n = tile * BLOCK_N + offs_bn
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tile_offs = offs_m[:, None] * MAX_BLOCK_N + offs_bn[None, :]
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for p in range(first, last + 1):
            head = _run_start(p, iters, progs) // k_blocks  # the first column block of p's run
            slot = p * 2 + (tile != head).to(tl.int32)
            acc += tl.load(part_ptr + slot * 16 * MAX_BLOCK_N + tile_offs, cache_modifier=".cg")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * y_m + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(arrive_ptr + tile, 0)  # ready for the next call


@triton.jit
def _skinny_streamk_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, arrive_ptr, M, N, K, x_m, w_n, y_m,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_SM: tl.constexpr, MAX_BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program p: iterations [p * iters // P, (p + 1) * iters // P) of (column block, K block), K fastest; acc
    [16, BLOCK_N] += x[16, BLOCK_K] @ W[BLOCK_N, BLOCK_K]^T, written (or stored as a partial) at each column
    block's end or the run's end. PER_SM only sizes the grid."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    k_blocks = tl.cdiv(K, BLOCK_K)
    iters = tl.cdiv(N, BLOCK_N).to(tl.int64) * k_blocks
    start = _run_start(pid, iters, progs)
    end = _run_start(pid + 1, iters, progs)
    head = start // k_blocks  # the column block the run starts in
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    offs_bn = tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    if USE_PDL:  # the run's first 1024 columns of its first rows head for L2 while the kernel before finishes
        lines = tl.minimum((start - head * k_blocks) * BLOCK_K + tl.arange(0, 16) * 64, K - 1)
        rows = w_ptr + tl.minimum(head * BLOCK_N + offs_bn, N - 1).to(tl.int64)[:, None] * w_n
        prefetch_l2(rows + lines[None, :])
    pdl_gate(USE_PDL)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for i in range(start, end):
        tile = i // k_blocks
        kb = i - tile * k_blocks
        offs_n = tile * BLOCK_N + offs_bn
        mask_n = offs_n < N
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        xk = tl.load(x_ptr + offs_m[:, None] * x_m + k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)  # [16, BLOCK_K]
        wk = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * w_n + k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                     other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(xk, tl.trans(wk), acc, input_precision=DOT_PRECISION)
        if (kb == k_blocks - 1) | (i == end - 1):  # the column block ends here, or the run does
            if (kb == k_blocks - 1) & (tile * k_blocks >= start):  # all of it in this run: y directly
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + offs_m[:, None] * y_m + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                         mask=mask_m[:, None] & mask_n[None, :])
            else:  # cut between runs: this run's share into its slot
                slot = pid * 2 + (tile != head).to(tl.int32)
                tl.store(part_ptr + slot * 16 * MAX_BLOCK_N + offs_m[:, None] * MAX_BLOCK_N + offs_bn[None, :], acc)
            acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    if (head * k_blocks < start) | ((head + 1) * k_blocks > end):
        _finish_block(head, k_blocks, iters, progs, part_ptr, arrive_ptr, bias_ptr, y_ptr, M, N, y_m, BLOCK_N,
                      MAX_BLOCK_N, HAS_BIAS)
    tail = (end - 1) // k_blocks
    if (tail != head) & ((tail + 1) * k_blocks > end):
        _finish_block(tail, k_blocks, iters, progs, part_ptr, arrive_ptr, bias_ptr, y_ptr, M, N, y_m, BLOCK_N,
                      MAX_BLOCK_N, HAS_BIAS)


_skinny_streamk = lean_launch(triton.autotune(configs=_configs(), key=["N", "K", "HAS_BIAS"],
                                              cache_results=PERSIST_AUTOTUNE)(_skinny_streamk_kernel))


def streamk_linear_triton(
    x2: torch.Tensor,  # [rows <= MAX_ROWS, K], rows contiguous
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None,  # [N]
    y: torch.Tensor,  # [rows, N] output, written
    workspace: StreamKWorkspace,
    pdl: dict[str, bool],  # pdl_launch(device)
) -> None:
    """Launch the stream-K kernel (skinny_linear_triton validates the arguments and calls this)."""
    rows, in_features = x2.shape
    out_features = weight.shape[0]
    if workspace.out_features != out_features or workspace.partials.device != weight.device:
        raise ValueError(f"stream-K workspace is for {workspace.out_features} columns on "
                         f"{workspace.partials.device}, the weight has {out_features} on {weight.device}")
    sms = _sm_count(weight.device)

    def grid(meta: dict) -> tuple[int]:
        iters = cdiv(out_features, meta["BLOCK_N"]) * cdiv(in_features, meta["BLOCK_K"])
        programs = INTERPRETER_PROGRAMS if interpreting() else meta["PER_SM"] * sms
        return (max(1, min(programs, iters, workspace.partials.shape[0])),)

    _skinny_streamk[grid](
        x2, weight, bias if bias is not None else weight, y, workspace.partials, workspace.arrivals, rows,
        out_features, in_features, x2.stride(0), weight.stride(0), y.stride(0), MAX_BLOCK_N=MAX_BLOCK_N,
        HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", **pdl,
    )
