"""Graceful drain: a worker process that gets SIGTERM during 20 streams finishes all 20 (health says
"draining", the router sends new requests elsewhere, the process exits 0); at the drain timeout the requests
left are aborted and their clients get an error, not a cut or hung stream."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from router_cluster import Cluster, tiny_model_dir

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.deploy.launch import start_worker_process
from hybridserve.deploy.options import WorkerOptions, new_internal_token
from hybridserve.engine.config import EngineConfig
from hybridserve.router.orchestrator import Orchestrator, WorkerError

ENGINE = EngineConfig(prefill_chunk_size=32, max_num_seqs=24, max_model_len=256)


def _wait_healthy(orchestrator: Orchestrator, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(h.health is not None and not h.draining for h in orchestrator.workers.all()) >= count:
            return
        time.sleep(0.05)
    raise TimeoutError("workers did not report healthy")


@pytest.mark.slow
def test_sigterm_during_20_streams_finishes_all_20() -> None:
    model_dir = tiny_model_dir()
    token = new_internal_token()  # process workers read it from their environment
    options = WorkerOptions(str(model_dir), ENGINE, internal_token=token, drain_timeout_s=120.0)
    workers = [start_worker_process(role, wid, options) for role, wid in
               (("prefill", "p0"), ("decode", "d0"), ("decode", "d1"))]
    prefill, d0, d1 = workers
    orchestrator = Orchestrator([prefill.address], [d0.address], internal_token=token)
    try:
        _wait_healthy(orchestrator, 2)
        params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        started = threading.Barrier(21, timeout=120)
        results: list[object] = [None] * 20

        def stream(i: int) -> None:
            tokens: list[int] = []
            try:
                for k, event in enumerate(orchestrator.generate([40 + i, 41, 42, 43], params)):
                    tokens += event.token_ids
                    if k == 0:
                        started.wait()
                results[i] = tokens
            except Exception as exc:
                results[i] = exc
                started.abort()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        started.wait()
        d0.process.send_signal(signal.SIGTERM)
        orchestrator.update_workers([prefill.address], [d0.address, d1.address])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(h.draining for h in orchestrator.workers.all()):
            time.sleep(0.05)
        # new work goes to the other decode worker while d0 finishes its streams
        short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        assert sum(len(e.token_ids) for e in orchestrator.generate([7, 8, 9], short)) == 4
        assert orchestrator.recent_decisions[-1][1].decode.address == d1.address
        for t in threads:
            t.join(timeout=300)
        assert [len(r) if isinstance(r, list) else r for r in results] == [120] * 20
        assert d0.process.wait(timeout=120) == 0
    finally:
        orchestrator.close()
        for w in workers:
            w.kill()


def test_at_the_drain_timeout_the_clients_left_get_an_error() -> None:
    cluster = Cluster(tiny_model_dir(), num_prefill=0, num_decode=1, router=False)
    decode = cluster.decode[0]
    step = decode.engine.step

    def slow_step(**kw):  # type: ignore[no-untyped-def]  # a long request is still running when the drain gives up
        time.sleep(0.02)
        return step(**kw)

    decode.engine.step = slow_step
    try:
        events = cluster.orchestrator.generate([5, 6, 7], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        next(events)
        aborted = decode.drain(0.3)
        assert len(aborted) == 1
        with pytest.raises(WorkerError, match="drain timeout"):
            list(events)
        assert decode.health().status == "draining"
        assert cluster.idle(timeout=5)
        cluster.check_pools()
    finally:
        cluster.stop()
