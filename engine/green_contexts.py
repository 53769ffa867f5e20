"""CUDA green contexts through the driver API (cuda-python's `cuda.bindings.driver`), for engine/sm_partition.py.

The driver calls are used directly, not torch's `GreenContext`, because only a split's result *and* remainder as
two contexts give disjoint SMs. Every context and stream made here is kept for the process's life.
"""

from __future__ import annotations

from typing import Any

import torch

# cuGreenCtxStreamCreate came with CUDA 12.5
MIN_DRIVER_VERSION = 12050


class PartitionUnavailable(RuntimeError):
    """SM partitions cannot be made here; the message says why in one line (no CUDA, no cuda-python, old driver)."""


def _load_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        raise PartitionUnavailable("cuda-python (cuda.bindings) is not installed: pip install 'cuda-python>=12.6'") from None
    for name in ("cuDevSmResourceSplitByCount", "cuGreenCtxCreate", "cuGreenCtxStreamCreate"):
        if not hasattr(driver, name):
            raise PartitionUnavailable(f"this cuda-python has no {name}: install cuda-python >= 12.6")
    return driver


class GreenContextDriver:
    """One device's SM resource and the green contexts split from it."""

    def __init__(self, driver: Any, device: torch.device, cu_device: Any, resource: Any) -> None:
        self._driver = driver
        self.device = device
        self._cu_device = cu_device
        self._resource = resource  # the whole device's SM resource
        self.total_sms = int(resource.sm.smCount)
        self.granularity = self._probe_granularity()
        self._kept: list[Any] = []  # green contexts and streams: never destroyed

    @classmethod
    def open(cls, device: torch.device) -> GreenContextDriver:
        """The driver view of a CUDA device; PartitionUnavailable where green contexts cannot be made."""
        if device.type != "cuda":
            raise PartitionUnavailable(f"SM partitions need a CUDA device, not {device}")
        if not torch.cuda.is_available():
            raise PartitionUnavailable("CUDA is not available to torch")
        driver = _load_driver()
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        torch.zeros(1, device=f"cuda:{index}")  # the runtime's primary context exists and is current
        version = _check(driver, driver.cuDriverGetVersion(), "cuDriverGetVersion")
        if int(version) < MIN_DRIVER_VERSION:
            raise PartitionUnavailable(f"the CUDA driver is {int(version)}; green-context streams need {MIN_DRIVER_VERSION}")
        cu_device = _check(driver, driver.cuDeviceGet(index), "cuDeviceGet")
        resource = _check(driver, driver.cuDeviceGetDevResource(cu_device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                          "cuDeviceGetDevResource")
        return cls(driver, torch.device("cuda", index), cu_device, resource)

    def _probe_granularity(self) -> int:
        """The smallest group the driver makes (a trial split asking for 1 SM returns the rounded-up count)."""
        groups, _, _ = self._split_resource(1)
        return int(groups[0].sm.smCount)

    def _split_resource(self, sms: int) -> tuple[Any, int, Any]:
        out = _check(self._driver, self._driver.cuDevSmResourceSplitByCount(1, self._resource, 0, sms),
                     f"cuDevSmResourceSplitByCount({sms})")
        groups, count, remaining = out
        if int(count) != 1:
            raise PartitionUnavailable(f"the driver made {int(count)} groups of {sms} SMs, not one")
        return groups, int(count), remaining

    def split(self, prefill_sms: int) -> tuple[tuple[int, torch.cuda.Stream], tuple[int, torch.cuda.Stream]]:
        """Two disjoint green contexts, `prefill_sms` SMs and the rest, each with a stream:
        ((prefill SMs, stream), (decode SMs, stream))."""
        groups, _, remaining = self._split_resource(prefill_sms)
        return self._context_stream(groups[0]), self._context_stream(remaining)

    def _context_stream(self, resource: Any) -> tuple[int, torch.cuda.Stream]:
        d = self._driver
        desc = _check(d, d.cuDevResourceGenerateDesc([resource], 1), "cuDevResourceGenerateDesc")
        ctx = _check(d, d.cuGreenCtxCreate(desc, self._cu_device, d.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                     "cuGreenCtxCreate")
        stream = _check(d, d.cuGreenCtxStreamCreate(ctx, d.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
                        "cuGreenCtxStreamCreate")
        self._kept += [desc, ctx, stream]
        handle = int(stream)
        return int(resource.sm.smCount), torch.cuda.ExternalStream(handle, device=self.device)


def _check(driver: Any, result: Any, what: str) -> Any:
    """A cuda-python call's (error, *values): the values, or PartitionUnavailable naming the call and the error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        label = name.decode() if isinstance(name, bytes) else str(name)
        raise PartitionUnavailable(f"{what} failed: {label}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
