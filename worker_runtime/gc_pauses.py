"""The garbage collector's pauses in this process, per generation (gc.callbacks): a served step that is slower
than the offline one may be the collector walking long-lived objects (the prefix cache's nodes) with the GIL held."""

from __future__ import annotations

import gc
import time

GENERATIONS = (0, 1, 2)


class GcPauses:
    """Sums pause time and counts collections by generation until closed. gc.callbacks is process-wide: every
    instance sees every collection of the process, whichever thread triggered it."""

    def __init__(self) -> None:
        self.total = 0.0  # seconds, all generations (a benchmark may reset it between phases)
        self.seconds = dict.fromkeys(GENERATIONS, 0.0)
        self.collections = dict.fromkeys(GENERATIONS, 0)
        self._since = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        # a collection runs with the GIL held from "start" to "stop": no other callback pair interleaves
        if phase == "start":
            self._since = time.perf_counter()
            return
        pause = time.perf_counter() - self._since
        generation = info.get("generation", 2)
        self.total += pause
        self.seconds[generation] = self.seconds.get(generation, 0.0) + pause
        self.collections[generation] = self.collections.get(generation, 0) + 1

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
