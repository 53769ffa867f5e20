"""A server process's start-up heap, frozen once it is ready: the garbage collector then never walks it again.

A worker or router process holds ~300-450 K Python objects after start-up (torch, transformers, Triton, the
model's modules, the CUDA graphs' bookkeeping); one full collection walks them all, 190-250 ms on the 2-core CI
box, with the GIL held: the engine loop and the token streams stop for that long whenever CPython decides on a
full collection while serving. `gc.freeze()` moves every object alive at that point into a permanent generation
that collections skip (vLLM and SGLang do the same after start-up); what serving allocates later is collected as
before. Called only in processes that are servers from start to end (`hybridserve worker`, `serve`'s main
process, the Ray actors), never in library code that a user's own process imports.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect once, then freeze what survived; returns the number of objects frozen (logged with `what`)."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: froze %d start-up objects out of the garbage collector's reach (%.0f ms)", what, frozen,
                1e3 * (time.perf_counter() - start))
    return frozen
