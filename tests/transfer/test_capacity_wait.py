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
    decode = cluster.decode[0]
    aborts: list[str] = []
    reserve, abort = decode.reserve, decode.abort
    refused: list[str] = []

    def counting_reserve(request_id, *args, **kwargs):  # noqa: ANN001, ANN202 - a pass-through wrapper
        try:
            return reserve(request_id, *args, **kwargs)
        except Exception:
            refused.append(request_id)
            raise

    def counting_abort(request_id: str) -> bool:
        aborts.append(request_id)
        return abort(request_id)

    monkeypatch.setattr(decode, "reserve", counting_reserve)
    monkeypatch.setattr(decode, "abort", counting_abort)
    try:
        prompts = random_prompts([20] * 8, vocab=128, seed=80)  # 8 requests, 2 decode slots
        with futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: cluster.generate(p, params), prompts))
        assert all(len(tokens) == 12 for tokens in got)
        assert refused, "the decode worker was never full: the test did not exercise the wait"
        # a refused Reserve created nothing, so nothing is aborted: a late Abort of the same request id used to
        # reach the worker after the retry's Reserve and kill it ("no reservation ... (aborted or expired)")
        assert aborts == []
        cluster.check_pools()
    finally:
        cluster.stop()
