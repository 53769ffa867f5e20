"""More requests than the decode worker has state slots: the router waits for a slot to free up (as a local
queue would) instead of refusing them with RESOURCE_EXHAUSTED / HTTP 429."""

from __future__ import annotations

from concurrent import futures

import test_disaggregated
import torch
from checkpoints import nemotron_h, random_prompts
from test_disaggregated import Cluster

from hybridserve import LLM, SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.transfer.state_layout import state_views


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


def test_states_beyond_the_decode_batch_land_in_standby_slots_and_join_as_seats_free(monkeypatch) -> None:
    """2 seats + 2 standby slots: remote prefills run ahead of the full batch, their states wait landed (holding
    their slot) and join oldest first; tokens equal the offline engine's, the batch never exceeds 2."""
    config = EngineConfig(prefill_chunk_size=64, max_num_seqs=2, standby_state_slots=2)
    monkeypatch.setattr(test_disaggregated, "CONFIG", config)
    model_dir, _ = nemotron_h("M*-M*")
    cluster = Cluster(model_dir, num_prefill=1, num_decode=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    decode = cluster.decode[0]
    scheduler = decode.engine.scheduler
    assert decode.engine.pool.slots is not None and decode.engine.pool.slots.capacity == 4
    landed: list[int] = []
    most_running: list[int] = []
    add_landed, schedule = scheduler.add_landed, scheduler.schedule

    def recording_add_landed(request) -> None:  # noqa: ANN001 - a pass-through wrapper
        add_landed(request)
        landed.append(len(scheduler.landed))

    def recording_schedule():  # noqa: ANN202 - a pass-through wrapper
        out = schedule()
        most_running.append(len(scheduler.running))
        return out

    monkeypatch.setattr(scheduler, "add_landed", recording_add_landed)
    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    try:
        prompts = random_prompts([20] * 8, vocab=128, seed=81)
        with futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: cluster.generate(p, params), prompts))
        offline = LLM(model_dir).generate(prompt_token_ids=prompts, sampling_params=params)
        assert got == [list(o.token_ids) for o in offline]
        assert max(landed) > 0, "no state ever waited for a seat: the test did not exercise standby slots"
        assert max(most_running) <= 2
        assert not scheduler.landed
        cluster.check_pools()
    finally:
        cluster.stop()


def test_a_landed_request_that_is_aborted_or_stops_at_once_frees_its_standby_slot() -> None:
    """In process: decode max_num_seqs=1 + 2 standby slots; one request runs, a second lands and waits; aborting
    the waiting one (and a third that finishes on its first token) leaves the pool exact and the first decoding."""
    model_dir, _ = nemotron_h("M*-M*")
    prefill = LLMEngine(model_dir, EngineConfig())
    decode = LLMEngine(model_dir, EngineConfig(max_num_seqs=1, standby_state_slots=2))

    def land(request_id: str, prompt: list[int], max_tokens: int) -> None:
        prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id, hold_state=True)
        first = None
        while prefill.has_unfinished():
            for out in prefill.step():
                first = out.token_ids[0] if out.token_ids else first
        exported = prefill.export_state(request_id)
        wire = torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in exported.parts])
        decode.reserve(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        decode.commit_reservation(request_id, state_views(wire, exported.specs), first, 0)

    prompts = random_prompts([12, 14, 9], vocab=128, seed=82)
    land("a", prompts[0], 6)
    land("b", prompts[1], 6)
    land("c", prompts[2], 1)  # finished by its first token: never takes a seat
    assert [r.request_id for r in decode.scheduler.running] == ["a"]
    assert [r.request_id for r in decode.scheduler.landed] == ["b"]
    assert decode.abort("b")
    assert not decode.scheduler.landed
    decode.pool.check()
    assert decode.pool.slots is not None and decode.pool.slots.num_used == 1
    while decode.has_unfinished():
        decode.step()
    decode.pool.check()
    assert decode.pool.slots.num_used == 0
    # a local request waiting for admission and landed states share the one seat: all finish, none starves
    land("d", prompts[0], 4)
    decode.add_request(prompts[1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), "local")
    land("e", prompts[2], 4)
    land("f", prompts[1], 4)
    finished = set()
    for _ in range(200):
        finished |= {o.request_id for o in decode.step() if o.finished}
        if not decode.has_unfinished():
            break
    assert finished == {"d", "local", "e", "f"}
    decode.pool.check()
    assert decode.pool.slots.num_used == 0
