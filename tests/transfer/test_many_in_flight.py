"""More requests in flight than the old gRPC handler pool (32 threads) could serve: every request holds a
token stream for its life and its state push needs threads too; a short pool deadlocked until the
reservations expired (found by the GPU serving benchmark). All requests must finish."""

from __future__ import annotations

from concurrent import futures

import test_disaggregated
from checkpoints import nemotron_h, random_prompts
from test_disaggregated import Cluster

from hybridserve import SamplingParams
from hybridserve.engine.config import EngineConfig

NUM_REQUESTS = 48


def test_48_concurrent_requests_all_finish(monkeypatch) -> None:
    monkeypatch.setattr(test_disaggregated, "CONFIG", EngineConfig(prefill_chunk_size=64, max_num_seqs=NUM_REQUESTS))
    model_dir, _ = nemotron_h("M*-M*")
    cluster = Cluster(model_dir, num_prefill=1, num_decode=1)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    try:
        prompts = random_prompts([60] * NUM_REQUESTS, vocab=128, seed=70)
        with futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
            calls = [pool.submit(cluster.generate, p, params) for p in prompts]
            done, pending = futures.wait(calls, timeout=100)  # a deadlock would hold them for the 120 s TTL
            assert not pending, f"{len(pending)} of {NUM_REQUESTS} requests still waiting: handler threads starved"
        assert all(len(c.result()) == 48 for c in done)
        cluster.check_pools()
    finally:
        cluster.stop()
