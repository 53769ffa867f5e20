"""The prefix cache's host work runs while the forward is on the device (`StatePool.commit_prefills`): what it
files is exactly what a commit after the forward files, with synchronous and async steps alike, and a forward
that fails takes all of it back (the synchronous step, whose forward raises where it runs)."""

from __future__ import annotations

import pytest
from checkpoints import random_prompts
from prefix_cases import cold_tokens, greedy, warm_llm

from hybridserve.statepool.events import EventKind


class _ForwardFailed(RuntimeError):
    pass


def _wrap_while_running(engine, wrap) -> None:
    """Run `wrap(hook)` in place of the work each step does while its forward runs (both step paths call it)."""
    original = engine._while_running

    def wrapped(prefills, clock, on_launched):
        hook = original(prefills, clock, on_launched)
        return lambda: wrap(hook)

    engine._while_running = wrapped


def _fail_next_forward(engine) -> None:
    """The next `execute` runs its `while_running` work, then raises (a device error after the launch)."""
    execute = engine.runner.execute

    def failing(*args, **kwargs):
        kwargs["while_running"]()
        engine.runner.execute = execute
        raise _ForwardFailed("injected")

    engine.runner.execute = failing


def _cache_view(engine) -> tuple[set[bytes], set[bytes]]:
    nodes = engine.pool.radix.nodes()
    return {n.block_hash for n in nodes}, {n.block_hash for n in nodes if n.checkpoint is not None}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefill_blocks_and_checkpoints_are_filed_during_the_forward(async_scheduling: bool) -> None:
    engine = warm_llm("nemotron_h", async_scheduling=async_scheduling).engine
    assert (engine.async_steps is not None) == async_scheduling
    prompt = random_prompts([70], vocab=128, seed=5)[0]
    engine.add_request(prompt, greedy(3))
    seen = {}

    def run_and_look(hook) -> None:
        hook()
        seen.setdefault("during", _cache_view(engine))

    _wrap_while_running(engine, run_and_look)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        engine.pool.check()
    blocks, states = seen["during"]
    assert len(blocks) == 70 // 8 and len(states) == 70 // 16  # the first step's chunk: the whole prompt
    assert outputs[-1].token_ids == cold_tokens("nemotron_h", tuple(prompt), 3)
    again = engine.add_request(prompt, greedy(3))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == again and out.finished:
                assert out.num_cached_tokens == 64 and out.token_ids == cold_tokens("nemotron_h", tuple(prompt), 3)


@pytest.mark.parametrize("shared", [False, True])
def test_a_failed_forward_takes_its_early_commit_back(shared: bool) -> None:
    engine = warm_llm("nemotron_h", async_scheduling=False).engine
    base = random_prompts([48], vocab=128, seed=6)[0]
    if shared:  # part of the failing prompt is cached already: those nodes stay, only the new ones go
        engine.add_request(base[:32] + [1, 2, 3], greedy(1))
        while engine.has_unfinished():
            engine.step()
    before = _cache_view(engine)
    engine.drain_cache_events()
    request_id = engine.add_request(base + [4, 5, 6], greedy(2))
    _fail_next_forward(engine)
    with pytest.raises(_ForwardFailed):
        engine.step()
    engine.pool.check()
    assert _cache_view(engine) == before
    events = engine.drain_cache_events()
    stored = {e.block_hash for e in events if e.kind is EventKind.BLOCK_STORED}
    removed = {e.block_hash for e in events if e.kind is EventKind.BLOCK_REMOVED}
    assert stored and stored == removed  # the router heard of the blocks, and of their removal
    assert engine.abort(request_id)
    engine.pool.check()
    assert _cache_view(engine) == before
    rerun = engine.add_request(base + [4, 5, 6], greedy(2))
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rerun
            if not out.finished:
                continue
            assert out.num_cached_tokens == (32 if shared else 0)
            assert out.token_ids == cold_tokens("nemotron_h", tuple(base + [4, 5, 6]), 2)
    engine.pool.check()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_eviction_and_hashing_happen_off_the_critical_path(async_scheduling: bool) -> None:
    """Once the cache is full, a stream of unique prompts evicts only inside `while_running` (the reserve of
    `keep_free_for` covers each admission and checkpoint plan), and prompts hashed by the caller are not rehashed."""
    engine = warm_llm("nemotron_h", num_kv_pages=40, num_checkpoint_slots=8, prefill_chunk_size=32,
                      async_scheduling=async_scheduling).engine
    pool, radix = engine.pool, engine.pool.radix
    in_window = [False]
    outside: list[str] = []
    for name in ("evict_pages", "evict_checkpoint"):
        original = getattr(radix, name)

        def spy(*args, _original=original, _name=name):
            if not in_window[0]:
                outside.append(_name)
            return _original(*args)

        setattr(radix, name, spy)

    def windowed(hook) -> None:
        in_window[0] = True
        try:
            hook()
        finally:
            in_window[0] = False

    _wrap_while_running(engine, windowed)
    hashed = []
    original_hashes = pool._hashes

    def counting_hashes(seq, num_blocks):
        if len(seq.block_hashes) < num_blocks:
            hashed.append(num_blocks)
        return original_hashes(seq, num_blocks)

    pool._hashes = counting_hashes
    prompts = random_prompts([40] * 12, vocab=128, seed=9)
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(2), block_hashes=pool.prompt_hashes(prompt))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    assert out.token_ids == cold_tokens("nemotron_h", tuple(prompt), 2)
            pool.check()
        if index >= 4:  # the cache has filled by now
            assert pool.pages.num_free >= 4 and pool.checkpoints.num_free >= 2
    assert outside == []
    assert all(n > 40 // 8 for n in hashed)  # only the generated tokens' blocks were hashed on the loop
