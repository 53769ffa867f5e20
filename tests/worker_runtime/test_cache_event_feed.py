"""The worker's cache-event feed: subscribers get exactly the events since their position, a gap when those
were dropped, a feed made after the engine's warm-up starts at the log's current sequence, and the loop files the
events while its forwards compute (or when it idles), not a thread of the feed's own."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from checkpoints import nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.worker_runtime.cache_event_feed import CacheEventFeed
from hybridserve.worker_runtime.engine_loop import EngineLoop


class _Context:
    def __init__(self, batches: int) -> None:
        self.left = batches

    def is_active(self) -> bool:
        self.left -= 1
        return self.left >= 0


def test_feed_streams_what_the_engine_cached_and_starts_after_warmup() -> None:
    model_dir, _ = nemotron_h("M*-M*")
    llm = LLM(model_dir, warmup=True, state_block=16, prefill_chunk_size=64, max_model_len=256)
    start = llm.engine.pool.events.next_sequence
    assert start > 0  # the warm-up cached (then dropped) prefixes: its events were drained
    loop = EngineLoop(llm.engine)
    try:
        feed = CacheEventFeed("w", loop, poll_s=0.01)
        snapshot = next(feed.stream(0, _Context(0), snapshot=True))
        assert snapshot.snapshot and snapshot.next_sequence == start and not snapshot.events
        prompt = random_prompts([40], vocab=128, seed=1)[0]
        list(loop.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0), "r"))
        batch = next(feed.stream(start, _Context(5)))
        sequences = [e.sequence for e in batch.events]
        assert not batch.gap and sequences == list(range(start, batch.next_sequence)) and sequences
        later = next(feed.stream(sequences[-2], _Context(5)))  # a subscriber that has all but the last one
        assert [e.sequence for e in later.events] == sequences[-2:]
    finally:
        loop.stop()


def test_a_subscriber_behind_the_buffer_gets_a_gap() -> None:
    engine = SimpleNamespace(pool=SimpleNamespace(events=SimpleNamespace(next_sequence=0)))
    loop = SimpleNamespace(engine=engine, call=lambda fn, timeout=None: fn())
    feed = CacheEventFeed("w", loop, capacity=4)  # type: ignore[arg-type]
    feed._draining = True  # no drain task on a loop: events are filed by hand below
    events = [SimpleNamespace(sequence=i, kind=SimpleNamespace(value="block_stored"), block_hash="ab",
                              parent_hash=None, num_tokens=16) for i in range(10)]
    with feed._changed:
        feed._append(events)
    batch = next(feed.stream(2, _Context(1)))
    assert batch.gap and [e.sequence for e in batch.events] == [6, 7, 8, 9] and batch.next_sequence == 10
    batch = next(feed.stream(8, _Context(1)))
    assert not batch.gap and [e.sequence for e in batch.events] == [8, 9]


def test_the_loop_files_events_while_forwards_run_and_when_idle() -> None:
    model_dir, _ = nemotron_h("M*-M*")
    llm = LLM(model_dir, state_block=16, prefill_chunk_size=16, max_model_len=256)
    loop = EngineLoop(llm.engine)
    drains: list[bool] = []  # idle flag of every drain that found events
    try:
        feed = CacheEventFeed("w", loop, poll_s=0.0)
        real = feed._drain_due

        def noted(idle: bool) -> None:
            before = feed._next_sequence
            real(idle)
            if feed._next_sequence > before:
                drains.append(idle)

        feed._drain_due = noted  # type: ignore[method-assign]
        start = feed._next_sequence
        next(feed.stream(start, _Context(0)), None)  # a subscriber came: the drain task is on the loop
        prompt = random_prompts([80], vocab=128, seed=2)[0]
        list(loop.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0), "r"))
        loop.call(lambda: None)  # one more trip: the loop idled after the request at least once
        batch = next(feed.stream(start, _Context(5)))
        assert [e.sequence for e in batch.events] == list(range(start, batch.next_sequence)) and batch.events
        assert False in drains  # filed while a forward computed (chunks of 16 tokens: several prefill steps)
        assert not [t for t in threading.enumerate() if t.name.endswith("-events")]  # no poller thread
    finally:
        loop.stop()
