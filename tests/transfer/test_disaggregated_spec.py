"""Disaggregated serving with MTP speculative decoding: the prefill worker computes the drafter's KV of the
prompt and ships the last hidden state; the decode worker drafts from its first step. Greedy output equals
plain in-process decoding; the decode worker's metrics count drafts and acceptances."""

from __future__ import annotations

import pytest
from checkpoints import nemotron_h_mtp, random_prompts
from router_cluster import Cluster

from hybridserve import LLM, SamplingParams
from hybridserve.decode_worker.worker import DecodeWorker
from hybridserve.engine.config import EngineConfig
from hybridserve.prefill_worker.worker import PrefillWorker
from hybridserve.router.orchestrator import Orchestrator
from hybridserve.transfer.planes import TransferConfig

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def SpecCluster(model_dir, rollback: str) -> Cluster:  # noqa: N802 - a factory
    """One prefill and one decode worker running MTP speculation, orchestrator only."""
    spec = {"method": "mtp", "num_speculative_tokens": 3, "rollback": rollback}
    config = EngineConfig(prefill_chunk_size=16, max_num_seqs=4, page_size=8, speculative_config=spec)
    return Cluster(model_dir, 1, 1, engine=config, transfer=TransferConfig(grpc_chunk_bytes=512), router=False)


@pytest.mark.parametrize("rollback", ["intermediate", "replay"])
def test_disaggregated_mtp_equals_plain_decoding(rollback: str) -> None:
    model_dir, _ = nemotron_h_mtp()
    prompts = random_prompts([6, 23, 40], vocab=128, seed=60)
    expected = [o.token_ids for o in LLM(model_dir, page_size=8).generate(prompt_token_ids=prompts,
                                                                      sampling_params=GREEDY)]
    cluster = SpecCluster(model_dir, rollback)
    try:
        assert [cluster.generate(p, GREEDY) for p in prompts] == expected
        decode = cluster.decode[0]
        metrics = decode.loop.call(lambda: decode.engine.spec.metrics)
        assert metrics.num_draft_tokens > 0  # the decode worker drafted from its very first step
        cluster.check_pools()
    finally:
        cluster.stop()


def test_prefill_and_decode_must_agree_on_speculation() -> None:
    """A decode worker with MTP (wider conv windows, drafter KV) cannot take a plain prefill worker's state:
    the handoff fails with a clear error instead of decoding from a wrong state."""
    model_dir, _ = nemotron_h_mtp()
    plain = EngineConfig(prefill_chunk_size=16, max_num_seqs=4, page_size=8)
    spec = EngineConfig(prefill_chunk_size=16, max_num_seqs=4, page_size=8,
                        speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prefill = PrefillWorker(model_dir, plain, transfer=TransferConfig(grpc_chunk_bytes=512))
    decode = DecodeWorker(model_dir, spec)
    for w in (prefill, decode):
        w.start()
    orchestrator = Orchestrator([prefill.address], [decode.address])
    try:
        with pytest.raises(Exception) as info:
            list(orchestrator.generate(random_prompts([30], vocab=128, seed=61)[0], GREEDY))
        assert "speculative_config" in str(info.value), str(info.value)
    finally:
        orchestrator.close()
        for w in (prefill, decode):
            w.stop(grace=0)
