"""A tensor-parallel leader whose follower rank dies raises RankError naming the rank and its exit status
within a bounded time, at start-up (in the rendezvous or while loading) and mid-run, instead of waiting on
the dead rank forever; a follower that is alive but stopped is named within the hang timeout; a script fed on
standard input (whose spawned follower cannot re-import it) fails fast."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from checkpoints import nemotron_h

from hybridserve import LLM, SamplingParams
from hybridserve.engine.tp_watch import RankError

LIMIT_S = 30.0
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def follower_pid(timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in multiprocessing.active_children():
            if child.name.startswith("hybridserve-tp-") and child.pid is not None:
                return child.pid
        time.sleep(0.01)
    raise TimeoutError("no follower process started")


def test_a_follower_that_dies_at_start_fails_the_engine_within_the_limit() -> None:
    model_dir, _ = nemotron_h("M*-M")
    outcome: list[BaseException | LLM] = []

    def build() -> None:
        try:
            outcome.append(LLM(model_dir, tensor_parallel_size=2, prefill_chunk_size=8))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    os.kill(follower_pid(), signal.SIGKILL)
    killed = time.monotonic()
    thread.join(LIMIT_S + 60)
    assert outcome, "the leader hung on its dead follower"
    assert time.monotonic() - killed < LIMIT_S
    error = outcome[0]
    assert isinstance(error, RankError), error
    assert "tensor-parallel rank 1" in str(error) and "SIGKILL" in str(error)


def test_a_follower_that_dies_mid_run_raises_and_every_later_step_does_too() -> None:
    model_dir, _ = nemotron_h("M*-M")
    llm = LLM(model_dir, tensor_parallel_size=2, prefill_chunk_size=8)
    try:
        assert len(llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY)[0].token_ids) == 4
        process = llm.engine.tp.processes[0]
        os.kill(process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankError, match="rank 1 .* was killed by SIGKILL"):
            llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=GREEDY)
        assert time.monotonic() - start < LIMIT_S
        assert llm.engine.tp.failure is not None
        with pytest.raises(RankError):
            llm.engine.tp.send([0])
    finally:
        llm.engine.close()


def test_a_follower_that_is_alive_but_stopped_is_named_within_the_hang_timeout() -> None:
    """SIGSTOP: the process lives, its sockets stay open, and a collective would wait 10 minutes; its heartbeat
    stands still, so the leader ends it and raises naming it."""
    model_dir, _ = nemotron_h("M*-M")
    llm = LLM(model_dir, tensor_parallel_size=2, prefill_chunk_size=8, tensor_parallel_hang_timeout_s=2.0)
    try:
        assert len(llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY)[0].token_ids) == 4
        process = llm.engine.tp.processes[0]
        os.kill(process.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankError, match=r"rank 1 .* is alive but has shown no sign of life for .*stopped or hung"):
            llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=GREEDY)
        assert time.monotonic() - start < LIMIT_S
        process.join(10)
        assert process.exitcode == -signal.SIGKILL  # ended, not left stopped
    finally:
        llm.engine.close()


def test_a_script_on_standard_input_fails_fast_naming_the_follower() -> None:
    model_dir, _ = nemotron_h("M*-M")
    script = textwrap.dedent(f"""
        from hybridserve import LLM
        LLM({str(model_dir)!r}, tensor_parallel_size=2)
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert time.monotonic() - start < LIMIT_S + 30  # the interpreter's own start-up and imports on top
    assert "RankError: tensor-parallel rank 1" in done.stderr and "exited with status 1" in done.stderr
