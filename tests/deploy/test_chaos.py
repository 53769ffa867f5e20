"""Chaos under load: four streaming clients while, in turn, a decode worker process is SIGKILLed,
a prefill worker dies, a decode worker process is SIGSTOPped for 10 s, a state transfer is corrupted, and
clients leave mid-stream. Every request ends exact (greedy tokens of an undisturbed run) or with a clean
error; requests without a token yet are retried elsewhere; afterwards nothing is held anywhere and the next
requests are exact. The harness is bench/system/chaos.py (bench/system/soak.py runs it for 30 minutes)."""

from __future__ import annotations

import logging

import pytest
from chaos import ChaosSystem, Outcomes, storm
from router_cluster import tiny_model_dir

logger = logging.getLogger(__name__)


@pytest.mark.slow
def test_faults_under_load_lose_nothing_and_leave_nothing_behind() -> None:
    system = ChaosSystem(tiny_model_dir())
    try:
        system.start_decode_process("chaos-d1")
        system.start_decode_process("chaos-d2")
        system.reference()
        outcomes = Outcomes()
        storm(system, outcomes, log=logger.warning)
        assert not outcomes.bad, outcomes.bad[:5]
        assert outcomes.counts["exact"] >= 20, outcomes.counts
        assert outcomes.counts["disconnected"] >= 1, outcomes.counts
        retried = sum(s.value for m in system.cluster.router.metrics.retries.collect() for s in m.samples
                      if s.name.endswith("_total"))
        # whether a request meets a dead worker before the health checks mark it down depends on the machine's
        # speed; the retry path itself is pinned by tests/router/test_routing.py, so here the count is only logged
        logger.warning("retries during the storm: %d", retried)
        problems = system.settle()
        assert not problems, problems
        for i, expected in system.expected.items():  # the next requests are exact
            assert system.request(i) == ("done", expected)
    finally:
        system.stop()
