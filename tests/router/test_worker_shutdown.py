"""Idle worker processes exit within 5 s of SIGTERM, with the router still connected (its sessions and cache
subscriptions open) or gone; a call that reaches a stopped engine loop fails instead of hanging the exit."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from router_cluster import ENGINE, MODEL_NAME

from hybridserve.deploy.launch import start_worker_process
from hybridserve.deploy.options import WorkerOptions
from hybridserve.router.app import Router
from hybridserve.router.config import RouterOptions

EXIT_LIMIT_S = 5.0


@pytest.mark.parametrize("router_first", [False, True])
def test_idle_workers_exit_within_5_s_of_sigterm(model_dir, router_first: bool) -> None:
    options = WorkerOptions(model_dir=str(model_dir), engine=ENGINE)
    workers = [start_worker_process("prefill", "p0", options), start_worker_process("decode", "d0", options)]
    router = Router(RouterOptions(str(model_dir), model_name=MODEL_NAME, http_port=0, grpc_port=0,
                                  max_model_len=ENGINE.max_model_len, warm_up_path=False),
                    [workers[0].address], [workers[1].address]).start()
    try:
        answer = httpx.post(f"http://{router.http_address}/v1/completions", timeout=60,
                            json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4})
        assert answer.status_code == 200
        if router_first:
            router.stop()
        start = time.monotonic()
        for worker in workers:
            worker.process.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.process.wait(timeout=30)
            assert worker.process.returncode == 0
        assert time.monotonic() - start < EXIT_LIMIT_S
    finally:
        if not router_first:
            router.stop()
        for worker in workers:
            worker.kill()


def test_a_call_on_a_stopped_loop_fails_at_once() -> None:
    from types import SimpleNamespace

    from hybridserve.worker_runtime.engine_loop import EngineLoop

    engine = SimpleNamespace(has_unfinished=lambda: False, config=SimpleNamespace(profile_dir=None))
    loop = EngineLoop(engine, late_handoff=False)  # type: ignore[arg-type]
    assert loop.call(lambda: 7) == 7
    loop.stop()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the engine loop stopped"):
        loop.call(lambda: 8)
    assert time.monotonic() - start < 1.0


def test_a_dead_tensor_parallel_rank_stops_the_loop_and_fails_its_requests() -> None:
    """A step that raises RankError fails the streams, stops the loop for good (health calls fail at once, so the
    router sees the worker unhealthy) and leaves the reason for the worker process, which then exits."""
    import queue
    from types import SimpleNamespace

    from hybridserve.engine.tp_watch import RankError
    from hybridserve.worker_runtime.engine_loop import EngineLoop

    busy = {"on": False}

    def step(**kw):  # type: ignore[no-untyped-def]
        raise RankError("tensor-parallel rank 1 (pid 1) was killed by SIGKILL")

    engine = SimpleNamespace(has_unfinished=lambda: busy["on"], step=step, abort=lambda rid: True,
                             config=SimpleNamespace(profile_dir=None))
    loop = EngineLoop(engine, late_handoff=False)  # type: ignore[arg-type]
    stream: queue.Queue = queue.Queue()
    loop.submit_to("r1", lambda: busy.update(on=True), stream)
    error = stream.get(timeout=10)
    assert isinstance(error, RuntimeError) and "rank 1" in str(error)
    deadline = time.monotonic() + 5
    while not loop.stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.stopped and isinstance(loop.fatal, RankError)
    with pytest.raises(RuntimeError, match="rank 1"):
        loop.call(lambda: 1)
