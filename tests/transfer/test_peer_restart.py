"""A decode worker restarted on the same address: the prefill worker's sender forgets what it learned of the old
one when a transfer finds it unreachable, asks the new one again, and the pair serves in-process tokens; a stopped
sender closes its channels."""

from __future__ import annotations

import grpc
import pytest
import torch
from checkpoints import nemotron_h, random_prompts
from router_cluster import Cluster

from hybridserve import LLM, SamplingParams
from hybridserve.decode_worker.worker import DecodeWorker
from hybridserve.engine.config import EngineConfig
from hybridserve.transfer.manifest import StateHeader
from hybridserve.transfer.planes import TransferConfig
from hybridserve.transfer.sender import StagedState, StateSender
from hybridserve.transfer.state_layout import StateTensorSpec

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(prefill_chunk_size=16, max_num_seqs=4)
TRANSFER = TransferConfig(grpc_chunk_bytes=512)


def _loose_state() -> StagedState:
    """A small state in loose host tensors (no arena block): what the sender moves when the arena is full."""
    spec = StateTensorSpec("kv", torch.float32, (4, 8))
    return StagedState([spec], [torch.zeros(spec.shape)], None, None)


def test_a_restarted_decode_worker_is_asked_again_and_serves() -> None:
    model_dir = nemotron_h("M*-M*")[0]
    cluster = Cluster(model_dir, engine=CONFIG, transfer=TRANSFER, router=False)
    try:
        sender, old = cluster.prefill[0].sender, cluster.decode[0]
        address, port = old.address, int(old.address.rsplit(":", 1)[1])
        prompts = random_prompts([40, 45], vocab=128, seed=70)
        reference = [o.token_ids for o in LLM(model_dir).generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
        assert cluster.generate(prompts[0], GREEDY) == reference[0]
        assert address in sender._peers  # learned on the first transfer

        old.stop(grace=0)
        header = StateHeader("no-ticket", "r-down", "fingerprint", 4, 1, 0)
        with pytest.raises(grpc.RpcError) as down:
            sender.send(address, header, _loose_state())
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert address not in sender._peers  # forgotten: the next transfer asks the peer again

        new = DecodeWorker(model_dir, CONFIG, port=port, worker_id="d0-restarted", transfer=TRANSFER)
        new.start()
        cluster.decode = [new]
        assert new.address == address
        assert cluster.generate(prompts[1], GREEDY) == reference[1]
        assert address in sender._peers
        cluster.check_pools()
    finally:
        cluster.stop()


def test_other_faults_keep_the_peer_and_a_closed_sender_refuses() -> None:
    model_dir = nemotron_h("M*-M*")[0]
    cluster = Cluster(model_dir, engine=CONFIG, transfer=TRANSFER, router=False)
    try:
        sender, address = cluster.prefill[0].sender, cluster.decode[0].address
        header = StateHeader("no-such-ticket", "r-bad", "fingerprint", 4, 1, 0)
        with pytest.raises(grpc.RpcError) as refused:  # the peer answers: a fault of the state, not of the peer
            sender.send(address, header, _loose_state())
        assert refused.value.code() != grpc.StatusCode.UNAVAILABLE
        assert address in sender._peers
        channels = list(sender._channels[address])
    finally:
        cluster.stop()
    with pytest.raises(RuntimeError, match="closed"):
        sender.peer(address)
    with pytest.raises(ValueError):  # grpc refuses calls on a closed channel
        channels[0].unary_unary("/hybridserve.v1.DecodeWorker/Health")(b"", timeout=5)


def test_a_sender_that_cannot_reach_a_peer_caches_nothing() -> None:
    sender = StateSender(TRANSFER, torch.device("cpu"))
    try:
        with pytest.raises(grpc.RpcError) as unreachable:
            sender.send("127.0.0.1:1", StateHeader("t", "r", "f", 4, 1, 0), _loose_state())
        assert unreachable.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert not sender._peers and not sender._channels
        assert sender.arena.free_bytes() == sender.arena.capacity
    finally:
        sender.close()
