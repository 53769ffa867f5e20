"""Weights read into L2 ahead of the projection that needs them, on a side stream (a batch-1 decode step).

Between a Mamba layer's in_proj and out_proj run three small kernels (conv update, state update, gated norm;
~7 us on an H200) that leave HBM nearly idle; so do attention's between its q/k/v and o projections. A
`L2Prefetcher` forks a side stream off the current one at that point, launches `l2_prefetch_triton` of the
coming weight there (it returns as soon as the prefetches are issued) and joins back before the layer ends, so
a CUDA-graph capture sees a fork and a join inside one layer (the engine's staged graphs cut between layers).
The projection then streams its weight from L2. Only weights that fit in half of L2 are fetched: a partial
prefetch does not shorten a one-wave kernel, whose slowest program still reads HBM.

Off with HYBRIDSERVE_L2_PREFETCH=0 (A/B runs); on for CUDA devices of compute capability 9.0 and later.
"""

from __future__ import annotations

import functools
import os

import torch

from hybridserve.kernels import ops

# which weights are fetched ahead: 1 = the Mamba out_proj and attention o_proj (after in_proj / q/k/v);
# 2 = also the MoE shared expert's up rows, forked after the norm before the router
_LEVELS = {"0": 0, "1": 1, "2": 2}


def prefetch_level() -> int:
    """HYBRIDSERVE_L2_PREFETCH (default 1), checked: an unknown value is an error, not silently off."""
    value = os.environ.get("HYBRIDSERVE_L2_PREFETCH", "1")
    if value not in _LEVELS:
        raise ValueError(f"HYBRIDSERVE_L2_PREFETCH={value!r}: use 0 (off), 1 (projections) or 2 (+ MoE shared)")
    return _LEVELS[value]


@functools.cache  # per device index: capability and L2 size never change within a process
def _device_supports(index: int) -> tuple[bool, int]:
    """(whether the device takes bulk L2 prefetches, its L2 size in bytes)."""
    props = torch.cuda.get_device_properties(index)
    return props.major >= 9, int(getattr(props, "L2_cache_size", 0))


class L2Prefetcher:
    """Forks L2 prefetches of weights onto a side stream and joins them back. One per model and device; made
    outside graph capture (the first eager decode step, i.e. warm-up), used by one forward at a time."""

    MIN_BYTES = 4 << 20  # smaller weights stream in a few microseconds anyway: not worth a launch

    def __init__(self, device: torch.device, level: int) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.level = level
        self.max_bytes = _device_supports(index)[1] // 2
        self.stream = torch.cuda.Stream(self.device, priority=-1)  # its few programs go ahead of queued ones
        self._pending = False
        self.launches = 0  # prefetch kernels queued (captured ones count once): tests and benchmarks read it

    @classmethod
    def wanted(cls, hidden: torch.Tensor) -> bool:
        """Whether a forward over `hidden` [N, D] should prefetch: a decode step small enough for the skinny
        projections (weight-read bound) on a Hopper-or-later GPU with Triton, and not turned off."""
        return (hidden.is_cuda and ops.triton_available() and hidden.shape[0] <= ops.skinny_max_rows()
                and _device_supports(hidden.device.index if hidden.device.index is not None
                                     else torch.cuda.current_device())[0]
                and prefetch_level() > 0)

    def fetch(self, weight: torch.Tensor, level: int = 1) -> None:
        """Ask L2 for `weight` on the side stream, ordered after everything queued so far on the current stream;
        skipped above this prefetcher's level, outside [MIN_BYTES, half of L2] and for non-contiguous weights."""
        nbytes = weight.numel() * weight.element_size()
        if (level > self.level or not self.MIN_BYTES <= nbytes <= self.max_bytes or not weight.is_contiguous()
                or weight.device != self.device):
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            ops.l2_prefetch(weight)
        self._pending = True
        self.launches += 1

    def join(self) -> None:
        """Order the current stream after the side stream's prefetch launches (a graph capture must end joined)."""
        if self._pending:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._pending = False
