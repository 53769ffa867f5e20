"""The collector's pauses are counted by generation while the counter is open, and not after it closed."""

from __future__ import annotations

import gc

from hybridserve.worker_runtime.gc_pauses import GcPauses


def test_collections_are_counted_and_timed_by_generation() -> None:
    pauses = GcPauses()
    try:
        gc.collect(0)
        gc.collect(2)
        assert pauses.collections[0] >= 1 and pauses.collections[2] >= 1
        assert pauses.seconds[2] > 0 and pauses.total >= pauses.seconds[2]
    finally:
        pauses.close()
    counted = dict(pauses.collections)
    gc.collect()
    assert pauses.collections == counted  # closed: the callback is gone
    pauses.close()  # closing twice is harmless
