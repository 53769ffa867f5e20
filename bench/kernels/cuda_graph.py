"""CUDA-graph capture for the benchmarks: decode-time work is timed as graph replays, as the engine runs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """Run fn once on a side stream (allocations, compiles), then capture it into a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
