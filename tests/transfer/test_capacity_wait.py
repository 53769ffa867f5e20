"""More requests than the decode worker has state slots: the router waits for a slot to free up (as a local
queue would) instead of refusing them with RESOURCE_EXHAUSTED / HTTP 429."""

from __future__ import annotations

from concurrent import futures

import test_disaggregated
from checkpoints import nemotron_h, random_prompts
from test_disaggregated import Cluster

from hybridserve import SamplingParams
from hybridserve.engine.config import EngineConfig


def test_requests_beyond_decode_capacity_wait_for_a_slot(monkeypatch) -> None:
    monkeypatch.setattr(test_disaggregated, "CONFIG", EngineConfig(prefill_chunk_size=64, max_num_seqs=2))
    model_dir, _ = nemotron_h("M*-M*")
    cluster = Cluster(model_dir, num_prefill=1, num_decode=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    try:
        prompts = random_prompts([20] * 8, vocab=128, seed=80)  # 8 requests, 2 decode slots
        with futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: cluster.generate(p, params), prompts))
        assert all(len(tokens) == 12 for tokens in got)
        cluster.check_pools()
    finally:
        cluster.stop()
