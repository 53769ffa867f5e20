"""Shared helpers for the Triton kernels: availability check, dt processing and launch-size choices.

Only imported on the GPU path (or by tests under TRITON_INTERPRET=1), so a CPU install needs no triton.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

# autotuned kernels store their timings in Triton's cache directory (TRITON_CACHE_DIR, default ~/.triton/cache)
# next to the compiled kernels, so a worker restarted on the same machine neither compiles nor autotunes again
# (the interpreter benchmarks nothing: nothing to keep)
PERSIST_AUTOTUNE = os.environ.get("TRITON_INTERPRET", "0") != "1"


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter (tests): launch one small config, no autotune."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """Ceil division in host code (grids, block counts): `triton.cdiv` is a constexpr function since Triton 3.6,
    which costs microseconds of argument unwrapping per host call (~270 calls per prefill step)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block shapes must be powers of two)."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def finite_limits(dt_limit: tuple[float, float]) -> tuple[float, float, bool]:
    """(lo, hi, has_limit) with inf replaced by a large finite bound so it can be passed as a float arg."""
    lo, hi = dt_limit
    has = not (lo == 0.0 and math.isinf(hi))
    return float(lo), float(min(hi, 3.0e38)), has


def check_same_device(*tensors: torch.Tensor | None) -> None:
    """Raise when the given tensors live on different devices (a kernel would read garbage)."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"tensors on different devices: {sorted(str(d) for d in devices)}")


@triton.jit
def process_dt_tl(dt, bias, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, dt_lo, dt_hi):
    """dt + bias, softplus (identity above 20, like torch), clamp to [dt_lo, dt_hi]; fp32 in and out."""
    dt = dt + bias
    if DT_SOFTPLUS:
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    return dt


def dot_launch(dtype: torch.dtype) -> dict[str, object]:
    """The DOT_PRECISION / DOT_UPCAST constexprs of a kernel whose tl.dot takes `dtype` activations: fp32 (and
    everything under the interpreter) exact ("ieee"), half precision on the GPU "tf32" (ignored by bf16 MMAs);
    DOT_UPCAST under the interpreter for bf16 and fp8, whose dot there is wrong (fp32 operands: the same exact
    products)."""
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 or interpreting() else "tf32",
            "DOT_UPCAST": interpreting() and dtype in (torch.bfloat16, torch.float8_e4m3fn)}


def pdl_enabled(device: torch.device) -> bool:
    """Whether decode kernels launch with programmatic dependent launch (Hopper and later, not under the
    interpreter): a kernel's programs may then start while the
    kernel before it finishes, stream weights that kernel cannot have written, and wait (`pdl_gate`) before
    touching anything else. Every kernel that opts in calls `pdl_gate` (or `pdl_wait`) first, so a chain stays
    ordered."""
    if device.type != "cuda":
        return False
    return _pdl_on_cuda_device(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel taking part in PDL: its USE_PDL constexpr and Triton's launch_pdl."""
    on = pdl_enabled(device)
    return {"USE_PDL": on, "launch_pdl": on}


@functools.cache  # asked at every launch: the answer for a device never changes within a process
def _pdl_on_cuda_device(index: int) -> bool:
    if interpreting():
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """`pdl_gate` without letting the next kernel launch: a kernel that calls this calls `pdl_trigger` once its
    work is done, so its successor's programs do not wait resident while it streams (the small MoE up kernel:
    the down kernel after it takes 25.5 instead of 27.4 us per 30B-A3B layer, bench/results/h200/decode_step/)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Let the next kernel start launching (after `pdl_wait`, at the end of the program's work)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_gate(USE_PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible, then let the next kernel
    start launching. Every program of a PDL kernel must pass here before reading activations or writing."""
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)


@triton.jit
def last_to_arrive(count_ptr, arrivals):
    """Count this program in at count_ptr after its partial results are stored; True for the last of `arrivals`
    programs, which may then read every partial. The CTA barrier first (every thread's stores issued before the
    count), then an acq_rel add: the partials are visible before the count, the last arrival sees all of them.
    The caller resets the count to 0 when done (ready for the next call and for CUDA-graph replays)."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="acq_rel") == arrivals - 1


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at `ptrs` (one pointer per 128-byte line is enough); nothing is returned or waited
    for. Used before `pdl_gate` on weights, which no earlier kernel writes."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def gemv_dot(a_row, w_rows, n_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
              DOT_UPCAST: tl.constexpr):
    """sum_k a[k] * W[n, k] for the tile's rows, fp32 [BLOCK_N]: a padded to the 16 rows a tl.dot takes (rows
    1.. masked off, no bytes), so Triton pipelines the weight loads (fp8 weights cast exactly to a's dtype). Beside
    `gemv_fma`: inside the 30B-A3B decode step the MoE down kernel gains by the pipelining, its up kernel loses.
    DOT_PRECISION / DOT_UPCAST: `triton_utils.dot_launch`."""
    pad = tl.arange(0, 16)[:, None]
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_row + pad * 0 + k[None, :], mask=(pad == 0) & k_ok[None, :], other=0.0)  # [16, BLOCK_K]
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        w = w.to(a.dtype)  # fp8 -> the activation dtype: exact
        if DOT_UPCAST:  # the interpreter's bf16 dot is wrong; fp32 operands give the same exact products
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return tl.sum(acc, 0)  # row 0 (the others are zeros)


@triton.jit
def gemv_fma(a_row, w_rows, n_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k a[k] * W[n, k] for the tile's rows (`w_rows`: [BLOCK_N] row pointers, `n_ok` their mask), fp32
    [BLOCK_N] by FMAs over [BLOCK_N, BLOCK_K] tiles (bf16 products are exact in fp32; fp8 casts exactly): the
    decode GEMV of the router logits and the MoE up kernel."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_row + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    return tl.sum(acc, 1)
