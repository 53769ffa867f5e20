"""Property: any stream of requests (shared prefixes, multi-turn follow-ups), aborts and evictions on a
small pool gives the tokens of cold runs, keeps `pool.check()` true after every step, and leaks nothing."""

from __future__ import annotations

from checkpoints import random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefix_cases import cold_tokens, greedy, warm_llm

MAX_TOKENS = 5
BASES = random_prompts([40, 40, 40], vocab=128, seed=31)
TAILS = random_prompts([12] * 6, vocab=128, seed=32)

request = st.tuples(
    st.integers(0, len(BASES) - 1),  # which shared prefix
    st.integers(0, 40),  # how much of it
    st.integers(0, len(TAILS) - 1),  # which tail
    st.integers(1, 12),  # how much of the tail
    st.booleans(),  # follow up on an earlier finished request instead (multi-turn)
    st.one_of(st.none(), st.integers(0, 6)),  # abort after this many steps
)
waves = st.lists(st.lists(request, min_size=1, max_size=4), min_size=1, max_size=3)


def _pool_engine(kind: str, checkpoint_rows: int = 2):
    # 10 pages of 8 tokens, 2 checkpoint rows (+ idle running slots), 3 running slots: eviction and preemption
    # happen often, and admissions take slots back from cached checkpoints
    return warm_llm(kind, num_kv_pages=10, num_checkpoint_slots=checkpoint_rows, max_num_seqs=3,
                    prefill_chunk_size=20).engine


def _check_stream(kind: str, stream: list, checkpoint_rows: int = 2) -> None:
    engine = _pool_engine(kind, checkpoint_rows)
    finished: dict[str, list[int]] = {}  # id -> prompt + output
    expected: dict[str, list[int]] = {}
    for wave in stream:
        abort_at: dict[str, int] = {}
        for base, cut, tail, tail_len, follow_up, abort_after in wave:
            prompt = BASES[base][:cut] + TAILS[tail][:tail_len]
            if follow_up and finished:
                prompt = sorted(finished.values(), key=len)[-1] + TAILS[tail][:tail_len]
            prompt = prompt[: 80 - MAX_TOKENS]
            request_id = engine.add_request(prompt, greedy(MAX_TOKENS))
            expected[request_id] = prompt
            if abort_after is not None:
                abort_at[request_id] = abort_after
        step = 0
        while engine.has_unfinished():
            for request_id, when in list(abort_at.items()):
                if when <= step:
                    engine.abort(request_id)
                    expected.pop(request_id)
                    del abort_at[request_id]
            for out in engine.step():
                if out.finished:
                    prompt = expected[out.request_id]
                    assert out.token_ids == cold_tokens(kind, tuple(prompt), MAX_TOKENS)
                    assert out.num_cached_tokens % 16 == 0 and out.num_cached_tokens < len(prompt)
                    finished[out.request_id] = prompt + out.token_ids
                    abort_at.pop(out.request_id, None)
            engine.pool.check()
            step += 1
    assert set(finished) == set(expected)
    pool = engine.pool
    # no sequence holds a slot; idle slots may hold cached checkpoints until the cache is cleared
    assert pool.slots.num_free + pool.checkpoints.num_borrowed == pool.slots.capacity
    engine.reset_prefix_cache()
    assert pool.slots.num_free == pool.slots.capacity and pool.checkpoints.num_borrowed == 0
    pool.check()
    assert pool.checkpoints.num_free == pool.checkpoints.capacity
    if pool.pages is not None:
        assert pool.pages.num_free == pool.num_pages
    assert pool.radix is not None and pool.radix.num_nodes == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=waves)
def test_random_streams_nemotron_h(stream: list) -> None:
    _check_stream("nemotron_h", stream)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=waves)
def test_random_streams_mamba2(stream: list) -> None:
    _check_stream("mamba2", stream)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=waves)
def test_random_streams_checkpoints_only_in_idle_slots(stream: list) -> None:
    _check_stream("nemotron_h", stream, checkpoint_rows=0)
