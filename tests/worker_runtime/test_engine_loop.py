"""The engine loop: a request is opened and added in one trip to the loop; failures close what was opened."""

from __future__ import annotations

import logging

import pytest
from checkpoints import nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.worker_runtime.engine_loop import EngineLoop

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loop():
    model_dir, _ = nemotron_h("M*")
    engine_loop = EngineLoop(LLM(model_dir).engine)
    yield engine_loop
    engine_loop.stop()


def test_generate_streams_the_tokens_of_the_offline_engine(loop: EngineLoop) -> None:
    prompt = random_prompts([9], vocab=128, seed=2)[0]
    outs = list(loop.generate(prompt, PARAMS, "a"))
    assert outs[-1].finished and len(outs[-1].token_ids) == 4
    assert outs[-1].text is None or isinstance(outs[-1].text, str)
    assert all(o.text is None for o in outs[:-1])  # text is decoded once, at the end
    assert loop.call(lambda: dict(loop._streams)) == {}  # the stream was closed


def test_a_refused_request_leaves_no_stream(loop: EngineLoop) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        loop.submit("bad", lambda: loop.engine.add_request([], PARAMS, "bad"))
    assert "bad" not in loop.call(lambda: dict(loop._streams))
    # the loop still serves
    assert list(loop.generate(random_prompts([5], vocab=128, seed=3)[0], PARAMS, "b"))[-1].finished


def test_a_posted_call_that_fails_is_logged_and_the_loop_goes_on(loop: EngineLoop,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    def boom() -> None:
        raise RuntimeError("posted failure")

    with caplog.at_level(logging.ERROR):
        loop.post(boom)
        assert loop.call(lambda: 42) == 42  # runs after the posted call
    assert "posted to the engine loop failed" in caplog.text


def test_a_consumer_that_stops_early_aborts_the_request(loop: EngineLoop) -> None:
    stream_outputs = loop.generate(random_prompts([7], vocab=128, seed=4)[0],
                                   SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True), "c")
    next(stream_outputs)
    stream_outputs.close()
    loop.call(lambda: None)  # the posted abort ran before this
    assert not loop.call(loop.engine.has_unfinished)


def test_a_consumer_behind_gets_the_newest_output_not_every_step(loop: EngineLoop) -> None:
    import queue as queue_mod

    from hybridserve.common.outputs import RequestOutput

    def out(tokens: list[int], finished: bool = False) -> RequestOutput:
        return RequestOutput("q", [1], tokens, None, "length" if finished else None, 0, finished)

    stream: queue_mod.Queue = queue_mod.Queue()
    for item in (out([5]), out([5, 6]), out([5, 6, 7]), out([5, 6, 7, 8], True)):
        stream.put(item)
    seen = [o.token_ids for o in loop.iterate("q", stream)]
    assert seen == [[5, 6, 7, 8]]  # three steps' outputs coalesced; the finished one is never skipped
    stream.put(out([1]))
    stream.put(RuntimeError("step failed"))
    with pytest.raises(RuntimeError, match="step failed"):
        list(loop.iterate("q2", stream))
