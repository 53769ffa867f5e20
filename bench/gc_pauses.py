"""The garbage collector's pause time while a benchmark runs: the library's counter (is a slow host step the
collector?), re-exported for the benchmarks that import it from here."""

from __future__ import annotations

from hybridserve.worker_runtime.gc_pauses import GcPauses

__all__ = ["GcPauses"]
