"""The garbage collector's pause time while a benchmark runs (gc.callbacks): is a slow host step the collector?"""

from __future__ import annotations

import gc
import time


class GcPauses:
    """Sums the garbage collector's pause time (gc.callbacks) until closed: is a slow host step the collector?"""

    def __init__(self) -> None:
        self.total = 0.0
        self._since = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._since

    def close(self) -> None:
        gc.callbacks.remove(self._callback)
