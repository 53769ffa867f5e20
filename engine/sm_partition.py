"""Disjoint SM partitions of one GPU, so that prefill and decode run side by side without taking each other's SMs.

Each partition is a CUDA green context made through the driver API (cuda-python's `cuda.bindings.driver`): the
device's SM resource is split in two disjoint groups (`cuDevSmResourceSplitByCount`: the prefill group and the
remainder), each group becomes a green context, and each context gets one stream (`cuGreenCtxStreamCreate`),
wrapped as a torch stream. Kernels launched on that stream run on the context's SMs only; memory, modules and the
caching allocator stay the primary context's, so tensors work across lanes. torch's own
`GreenContext.create(num_sms=...)` is not used: it keeps the first group of each split it makes, so two contexts
made that way share SMs.

Contexts are made once per process, for every split of a menu, and kept for the process's life: destroying or
popping a green context and making another in the same thread left CUDA-graph capture broken for the rest of the
process. A `Lane` never makes its context current either; it only switches the current torch stream.

`fake_partitioner` gives the same objects with no streams, for CPU tests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridserve.engine.green_contexts import GreenContextDriver, PartitionUnavailable

if TYPE_CHECKING:
    import torch

__all__ = ["LANES", "Lane", "PartitionUnavailable", "SmPartitioner", "SmSplit", "active_lane", "fake_partitioner",
           "MIN_LANE_GROUPS", "open_partitioner", "plan_splits"]

logger = logging.getLogger(__name__)

LANES = ("prefill", "decode")
# Hopper's driver hands SMs out in groups of 8 (queried on the device by a trial split; this is the fake's default)
DEFAULT_SM_GRANULARITY = 8

@dataclass(frozen=True)
class SmSplit:
    """SM counts of the two lanes of one split; disjoint, so together at most the device's SMs."""

    prefill_sms: int
    decode_sms: int

    def __post_init__(self) -> None:
        for name in ("prefill_sms", "decode_sms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SmSplit.{name} must be a positive int, got {value!r}")

    def sms(self, lane: str) -> int:
        """The SM count of lane "prefill" or "decode"."""
        if lane == "prefill":
            return self.prefill_sms
        if lane == "decode":
            return self.decode_sms
        raise ValueError(f"lane must be one of {LANES}, got {lane!r}")

    def __str__(self) -> str:
        return f"{self.prefill_sms}P/{self.decode_sms}D"


_active = threading.local()  # .stack: the lanes this thread has entered, innermost last


def active_lane() -> Lane | None:
    """The lane this thread launches into now (the innermost one entered), or None outside every lane."""
    stack: list[Lane] = getattr(_active, "stack", [])
    return stack[-1] if stack else None


class Lane:
    """Where one phase's kernels run: `with lane:` makes the lane's stream the current torch stream of this thread
    (on the fake partition it only records the lane, see `active_lane`). Entering nests and is per thread."""

    def __init__(self, name: str, sm_count: int, stream: torch.cuda.Stream | None) -> None:
        if name not in LANES:
            raise ValueError(f"lane name must be one of {LANES}, got {name!r}")
        self.name = name
        self.sm_count = sm_count
        self.stream = stream
        self._contexts = threading.local()  # .stack: this thread's torch stream contexts, innermost last

    def __enter__(self) -> Lane:
        if self.stream is not None:
            import torch

            ctx = torch.cuda.stream(self.stream)
            ctx.__enter__()
            self._stream_stack().append(ctx)
        if not hasattr(_active, "stack"):
            _active.stack = []
        _active.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.stack.pop()
        if self.stream is not None:
            self._stream_stack().pop().__exit__(None, None, None)

    def _stream_stack(self) -> list[Any]:
        if not hasattr(self._contexts, "stack"):
            self._contexts.stack = []
        stack: list[Any] = self._contexts.stack
        return stack

    def wait_for(self, other: Lane) -> None:
        """Work queued on this lane from now on starts after the work queued on `other` so far (an event, no host
        wait): e.g. decode reading a state the prefill lane has just written. No-op on the fake partition."""
        if self.stream is not None and other.stream is not None and other.stream != self.stream:
            self.stream.wait_stream(other.stream)

    def graph(self, graph: torch.cuda.CUDAGraph, pool: Any = None) -> Any:
        """`with lane.graph(g, pool):` captures `g` on this lane's stream. A graph's kernels keep the SMs of the
        context they were captured in, wherever they are replayed (measured: bench/results/h200/multiplex/), so a
        lane's graphs must be captured this way; a graph captured on a plain stream runs on the whole GPU."""
        if self.stream is None:
            raise RuntimeError(f"{self!r} is a fake lane (no stream): CUDA graphs need a green-context lane")
        import torch

        return torch.cuda.graph(graph, pool=pool, stream=self.stream)

    def synchronize(self) -> None:
        """Block the host until the work queued on this lane is done."""
        if self.stream is not None:
            self.stream.synchronize()

    def __repr__(self) -> str:
        return f"Lane({self.name!r}, sm_count={self.sm_count})"


# the fewest groups a lane may have: with a decode lane of one group plus the remainder (12 of the H200's 132 SMs)
# served steps failed in cuBLAS's bf16 GEMMs (CUBLAS_STATUS_EXECUTION_FAILED; bench/results/h200/multiplex/)
MIN_LANE_GROUPS = 2


def plan_splits(total_sms: int, granularity: int, prefill_sms_menu: Iterable[int],
                min_lane_groups: int = MIN_LANE_GROUPS) -> tuple[SmSplit, ...]:
    """The splits a menu of prefill SM counts gives: each count rounded up to the driver's granularity (and to at
    least `min_lane_groups` groups), the decode lane taking the rest (at least as many groups); duplicates after
    rounding dropped, ordered by prefill SMs. Serving keeps MIN_LANE_GROUPS; a measurement may go lower.
    PartitionUnavailable where the device is too small for two such lanes; ValueError for a menu it cannot give."""
    if min_lane_groups < 1:
        raise ValueError(f"min_lane_groups must be >= 1, got {min_lane_groups}")
    least = min_lane_groups * granularity
    if total_sms < 2 * least:
        raise PartitionUnavailable(f"{total_sms} SMs cannot hold two partitions of {least} SMs")
    menu = tuple(prefill_sms_menu)
    if not menu:
        raise ValueError("the prefill SM menu is empty: name at least one prefill SM count")
    splits: dict[int, SmSplit] = {}
    for want in menu:
        if not isinstance(want, int) or isinstance(want, bool) or want <= 0:
            raise ValueError(f"prefill SM counts must be positive ints, got {want!r}")
        prefill = max(-(-want // granularity) * granularity, least)
        if total_sms - prefill < least:
            most = (total_sms - least) // granularity * granularity
            raise ValueError(f"{want} prefill SMs (rounded up to {prefill}, a multiple of {granularity}) leave fewer "
                             f"than {least} of the device's {total_sms} SMs for decode; use at most {most}")
        splits[prefill] = SmSplit(prefill, total_sms - prefill)
    return tuple(splits[p] for p in sorted(splits))


class SmPartitioner:
    """The lanes of every split of a menu, made once per process and kept for its life."""

    def __init__(self, total_sms: int, granularity: int, lanes: dict[SmSplit, tuple[Lane, Lane]], *,
                 fake: bool, keep: tuple[object, ...] = ()) -> None:
        self.total_sms = total_sms
        self.granularity = granularity
        self.splits: tuple[SmSplit, ...] = tuple(sorted(lanes, key=lambda s: s.prefill_sms))
        self.fake = fake
        self._lanes = dict(lanes)
        self._keep = keep  # driver handles (green contexts, streams): never destroyed, see the module docstring

    def lanes(self, split: SmSplit) -> tuple[Lane, Lane]:
        """(prefill lane, decode lane) of one split of the menu; their SMs are disjoint."""
        try:
            return self._lanes[split]
        except KeyError:
            raise ValueError(f"split {split} is not in this partitioner's menu "
                             f"({', '.join(str(s) for s in self.splits)})") from None

    def nearest(self, prefill_sms: int) -> SmSplit:
        """The menu's split whose prefill SM count is closest to `prefill_sms` (ties: the smaller one)."""
        return min(self.splits, key=lambda s: (abs(s.prefill_sms - prefill_sms), s.prefill_sms))

    def describe(self) -> str:
        kind = "fake" if self.fake else "green contexts"
        return (f"{self.total_sms} SMs in groups of {self.granularity} ({kind}): "
                + ", ".join(str(s) for s in self.splits))


def fake_partitioner(total_sms: int, prefill_sms_menu: tuple[int, ...],
                     granularity: int = DEFAULT_SM_GRANULARITY) -> SmPartitioner:
    """A partitioner with the real one's menu arithmetic and lanes without streams, for CPU tests."""
    splits = plan_splits(total_sms, granularity, prefill_sms_menu)
    lanes = {s: (Lane("prefill", s.prefill_sms, None), Lane("decode", s.decode_sms, None)) for s in splits}
    return SmPartitioner(total_sms, granularity, lanes, fake=True)


def open_partitioner(device: torch.device, prefill_sms_menu: tuple[int, ...],
                     min_lane_groups: int = MIN_LANE_GROUPS) -> SmPartitioner:
    """Green-context lanes for every split of the menu on one CUDA device (contexts made now, kept for the
    process's life); raises PartitionUnavailable with the reason where the device cannot be split, and ValueError
    (what to change) for a menu entry this device cannot give."""
    driver = GreenContextDriver.open(device)
    total, granularity = driver.total_sms, driver.granularity
    splits = plan_splits(total, granularity, prefill_sms_menu, min_lane_groups)
    lanes: dict[SmSplit, tuple[Lane, Lane]] = {}
    for split in splits:
        (prefill_sms, prefill_stream), (decode_sms, decode_stream) = driver.split(split.prefill_sms)
        if (prefill_sms, decode_sms) != (split.prefill_sms, split.decode_sms):
            raise PartitionUnavailable(f"the driver split {split} as {prefill_sms}P/{decode_sms}D")
        lanes[split] = (Lane("prefill", prefill_sms, prefill_stream), Lane("decode", decode_sms, decode_stream))
    partitioner = SmPartitioner(total, granularity, lanes, fake=False, keep=(driver,))
    logger.info("SM partitions: %s", partitioner.describe())
    return partitioner
