"""Triton L2 prefetch: ask L2 for a tensor's bytes without reading them into registers (Hopper's bulk prefetch).

A batch-1 decode step is a chain of weight reads with small kernels between them (conv and state updates, norms,
attention) that leave HBM idle for microseconds. Launched on a side stream (`kernels/l2_prefetch.py`) while those
run, this kernel brings the next projection's weight into L2, so the projection then streams it from L2.
Nothing is computed, so there is no torch reference beyond `l2_prefetch_ref` doing nothing: the oracle is that
every output stays bit-identical with prefetching on (tests/kernels/test_l2_prefetch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.kernels.launch import lean_launch
from hybridserve.kernels.triton_utils import cdiv, prefetch_l2

CHUNK = 4096  # bytes one lane asks for (a multiple of the bulk prefetch's 16-byte granule)
LANES = 32  # lanes per program (one warp)
LINE = 128  # bytes of one L2 line (the per-line variant asks for each)


@triton.jit
def _bulk_prefetch_l2(ptrs, sizes):
    """One `cp.async.bulk.prefetch.L2` of sizes[i] bytes at ptrs[i] per lane (sm_90+); lanes with size 0 skip."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


@lean_launch
@triton.jit
def _l2_prefetch_kernel(src_ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr,
                        LINE: tl.constexpr):
    """Program p asks L2 for bytes [p * LANES * CHUNK, (p + 1) * LANES * CHUNK) of src (a uint8 view): one bulk
    prefetch of CHUNK bytes per lane, or (BULK=False, pre-Hopper) one `prefetch.global.L2` per 128-byte line."""
    starts = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK  # [LANES]
    if BULK:
        sizes = tl.minimum(tl.maximum(nbytes - starts, 0), CHUNK).to(tl.int32)  # nbytes: a multiple of 16
        _bulk_prefetch_l2(src_ptr + starts, sizes)
    else:
        for line in range(0, CHUNK, LINE):
            offs = tl.minimum(starts + line, nbytes - 1)
            prefetch_l2(src_ptr + offs)


def l2_prefetch_ref(tensor: torch.Tensor) -> None:
    """The reference: a prefetch changes no value, so there is nothing to do."""


def l2_prefetch_triton(tensor: torch.Tensor, bulk: bool = True) -> None:
    """Ask L2 for every byte of `tensor` (contiguous, CUDA) on the current stream; returns at once. The bulk form
    needs sm_90 and 16-byte aligned storage of whole 16-byte granules; other tensors take the per-line form."""
    if not tensor.is_cuda:
        raise ValueError(f"l2_prefetch_triton needs a CUDA tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("l2_prefetch_triton needs a contiguous tensor (prefetch its .contiguous() source instead)")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    flat = tensor.reshape(-1).view(torch.uint8)  # [nbytes]
    bulk = (bulk and nbytes % 16 == 0 and tensor.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(tensor.device)[0] >= 9)
    _l2_prefetch_kernel[(cdiv(nbytes, CHUNK * LANES),)](  # on the current device: the caller's
        flat, nbytes, CHUNK=CHUNK, LANES=LANES, BULK=bulk, LINE=LINE, num_warps=1)
