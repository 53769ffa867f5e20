"""1,024 concurrent clients on a small CPU server with default settings: every request completes, none is
refused. The router runs what the decode worker reports it holds and queues the rest in order; with the router's
limit lifted, the worker's own "full" answers (its queue, its seats for remote prefills) queue the same way."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
from router_cluster import ENGINE, MODEL_NAME, Cluster

from hybridserve.router.config import AdmissionConfig

CLIENTS = 1024
# the test checkpoint's engine with a batch of 64 and room to prefill them together (fewer steps on CPU)
SERVER = dataclasses.replace(ENGINE, max_num_seqs=64, prefill_chunk_size=1024)


async def _flood(base_url: str, clients: int) -> list[int]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(600.0)) as http:
        async def one(i: int) -> int:
            body = {"model": MODEL_NAME, "prompt": f"client {i} says", "max_tokens": 2, "temperature": 0,
                    "ignore_eos": True}
            response = await http.post("/v1/completions", json=body)
            if response.status_code == 200:
                assert response.json()["usage"]["completion_tokens"] == 2
            return response.status_code

        return await asyncio.gather(*(one(i) for i in range(clients)))


def test_1024_concurrent_clients_all_complete_with_defaults(model_dir) -> None:
    cluster = Cluster(model_dir, num_prefill=0, num_decode=1, engine=SERVER)
    try:
        router = cluster.router
        assert router is not None
        health = cluster.orchestrator.workers.snapshot()[1][0].health
        assert health is not None and health.max_running == SERVER.max_num_seqs
        assert health.max_num_waiting == SERVER.max_num_waiting
        assert router.frontend.admission.limit == 2 * SERVER.max_num_seqs  # one batch running, one queued
        statuses = asyncio.run(_flood(cluster.base_url, CLIENTS))
        assert statuses.count(200) == CLIENTS, {s: statuses.count(s) for s in set(statuses)}
        assert router.frontend.admission.running == 0 and router.frontend.admission.queued == 0
        assert cluster.idle()
        cluster.check_pools()
    finally:
        cluster.stop()


@pytest.mark.slow
def test_decode_workers_full_queues_instead_of_refusing(model_dir) -> None:
    """Admission lifted: every request reaches the workers; the decode worker's full seats (remote prefill) and
    full queue (local) are waited out in its seat queue, never answered 429."""
    cluster = Cluster(model_dir, num_prefill=1, num_decode=1,
                      admission=AdmissionConfig(max_running=CLIENTS))
    try:
        statuses = asyncio.run(_flood(cluster.base_url, CLIENTS // 2))
        assert statuses.count(200) == CLIENTS // 2, {s: statuses.count(s) for s in set(statuses)}
        assert cluster.orchestrator.metrics.seat_waits._value.get() > 0  # the full path was taken, and waited
        assert cluster.idle()
        cluster.check_pools()
    finally:
        cluster.stop()
