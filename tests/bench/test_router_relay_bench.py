"""bench/router_relay_variants.py runs end to end: a stub worker, three relay kinds, every call answered."""

from __future__ import annotations

import router_relay_variants  # bench/ is on pytest's pythonpath


def test_every_relay_kind_answers_and_reports_its_added_latency() -> None:
    result = router_relay_variants.measure(rounds=1, block=3)
    assert set(result["added_p50_ms"]) == {"aio", "aio_unix_socket", "sync_threads"}
    assert result["calls_per_kind"] == 3 and all(v > 0 for v in result["p50_ms"].values())
