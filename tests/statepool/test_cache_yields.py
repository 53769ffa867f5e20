"""The prefix cache lives in what running requests do not use: checkpoints sit in idle running slots and are
evicted the moment a request needs the slot, so cached state never keeps a request waiting; a hit whose
checkpoint is the last idle slot takes that row over without a copy."""

from __future__ import annotations

from checkpoints import random_prompts
from prefix_cases import cold_tokens, greedy, warm_llm

from hybridserve.engine.cache_plan import profile_forward_bytes
from hybridserve.statepool.sizing import PoolRequest, cpu_budget_bytes


def test_checkpoints_in_idle_slots_are_evicted_when_requests_need_the_slots() -> None:
    llm = warm_llm("nemotron_h", max_num_seqs=3, num_checkpoint_slots=0)  # no checkpoint rows of their own
    engine, pool = llm.engine, llm.engine.pool
    warm = random_prompts([70], vocab=128, seed=41)[0]
    llm.generate(prompt_token_ids=[warm], sampling_params=greedy(3))
    assert pool.checkpoints.num_borrowed > 0  # the finished request's checkpoints sit in idle slots
    pool.check()
    cold = random_prompts([30, 31, 33], vocab=128, seed=42)  # no shared prefix: nothing to hit
    ids = [engine.add_request(p, greedy(4)) for p in cold]
    engine.step()  # the first step admits all three: the cache gave its slots back at once
    assert len(engine.scheduler.running) == 3 and not engine.scheduler.waiting
    assert pool.slots.num_free == 0 and pool.checkpoints.num_borrowed == 0
    pool.check()
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        pool.check()
    assert [done[i] for i in ids] == [cold_tokens("nemotron_h", tuple(p), 4) for p in cold]


def test_a_hit_in_the_last_idle_slot_takes_its_row_over() -> None:
    llm = warm_llm("nemotron_h", max_num_seqs=2, num_checkpoint_slots=0)
    engine, pool = llm.engine, llm.engine.pool
    first = random_prompts([50], vocab=128, seed=43)[0]
    out = llm.generate(prompt_token_ids=[first], sampling_params=greedy(2))[0]
    assert pool.checkpoints.num_borrowed == 1 and pool.slots.num_free == 1  # the other row holds a checkpoint
    other = random_prompts([20], vocab=128, seed=45)[0]
    follow_up = first + out.token_ids + random_prompts([9], vocab=128, seed=44)[0]
    ids = [engine.add_request(other, greedy(3)), engine.add_request(follow_up, greedy(3))]
    engine.step()  # `other` takes the free row; the follow-up's hit is the only checkpoint left: its row
    assert len(engine.scheduler.running) == 2 and pool.checkpoints.num_borrowed == 0
    pool.check()
    done: dict[str, tuple[list[int], int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = (o.token_ids, o.num_cached_tokens)
        pool.check()
    assert done[ids[0]][0] == cold_tokens("nemotron_h", tuple(other), 3)
    assert done[ids[1]][0] == cold_tokens("nemotron_h", tuple(follow_up), 3)
    assert done[ids[1]][1] > 0  # it resumed from the checkpoint that became its slot


def test_cpu_budget_follows_max_num_seqs_and_the_profiling_forward_runs() -> None:
    small, large = (warm_llm("nemotron_h", max_num_seqs=n).engine for n in (2, 16))
    for engine, seqs in ((small, 2), (large, 16)):
        layout = engine.cache.layout
        assert layout.num_slots == seqs  # never lowered on CPU: the budget grew with max_num_seqs
        assert layout.num_pages * layout.page_size >= seqs * engine.max_model_len
    want = PoolRequest(max_num_seqs=16, max_model_len=160, page_size=8, conv_width=3,
                       dtype=small.config.torch_dtype, ssm_dtype=small.cache.ssm_states.dtype)
    assert cpu_budget_bytes(small.model_config, want) > cpu_budget_bytes(small.model_config,
                                                                         PoolRequest(**{**want.__dict__,
                                                                                        "max_num_seqs": 2}))
    mamba = small.model_config.mamba
    assert mamba is not None
    # the start-up profiling forward (measured on CUDA) runs on CPU on its one-request scratch cache
    assert profile_forward_bytes(small.model, small.model_config, small.config, mamba.conv_kernel - 1,
                                 small.cache.ssm_states.dtype, decode_rows=4) == 0
