"""A --pd-multiplex decode worker behind the router (no prefill workers): on CPU it says it runs co-located and
answers; with the fake partition attached its loop runs the multiplexed step (prefill held in flight over decode
steps) and answers with the co-located worker's greedy tokens, its split and handoffs on /metrics. The CLI has the
flag, and a deployment with prefill workers beside multiplexed decode workers is refused."""

from __future__ import annotations

import dataclasses
import threading

import httpx
import pytest
from checkpoints import random_prompts
from prometheus_client.parser import text_string_to_metric_families
from router_cluster import ENGINE, Cluster, tiny_model_dir

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.deploy.options import ServeOptions, WorkerOptions
from hybridserve.engine import multiplex, multiplex_setup
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.sm_partition import fake_partitioner
from hybridserve.router.config import RouterOptions

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _answers(cluster: Cluster, prompts: list[list[int]]) -> list[list[int] | BaseException]:
    """Greedy tokens of every prompt, all requests at once (they arrive while the others decode)."""
    results: list[list[int] | BaseException] = [[] for _ in prompts]

    def run(i: int) -> None:
        try:
            results[i] = cluster.generate(prompts[i], GREEDY)
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_multiplexed_worker_answers_with_colocated_tokens() -> None:
    model_dir = tiny_model_dir()
    prompts = random_prompts([5, 40, 70, 12, 33, 90], vocab=320, seed=21)
    plain = Cluster(model_dir, num_prefill=0, num_decode=1, router=False)
    try:
        expected = [plain.generate(p, GREEDY) for p in prompts]
    finally:
        plain.stop()
    cluster = Cluster(model_dir, num_prefill=0, num_decode=1, engine=dataclasses.replace(ENGINE, pd_multiplex=True))
    try:
        worker = cluster.decode[0]
        assert worker.loop.call(lambda: worker.engine.multiplexer) is None  # CPU: co-located, with a WARNING
        assert _answers(cluster, prompts[:2]) == expected[:2]

        def attach() -> multiplex.Multiplexer:
            mux = multiplex_setup.attach(worker.engine, fake_partitioner(132, (32, 64, 96)))
            mux.prefill_delay = 2
            return mux

        mux = worker.loop.call(attach)
        assert _answers(cluster, prompts) == expected
        assert cluster.idle()
        stats = worker.loop.call(mux.stats)
        assert 0 < stats["handoffs"] <= len(prompts) and stats["whole_gpu_steps"] > 0  # the first prompt: alone
        cluster.check_pools()
        text = httpx.get(f"http://127.0.0.1:{worker.metrics.port}/metrics", timeout=10).text
        assert f'hybridserve_worker_pd_multiplex_handoffs_total{{role="decode"}} {float(stats["handoffs"])}' in text
        assert (f'hybridserve_worker_pd_multiplex_whole_gpu_steps_total{{role="decode"}} '
                f'{float(stats["whole_gpu_steps"])}') in text
        assert 'hybridserve_worker_pd_multiplex_decode_sms{role="decode"}' in text
        # each lane's rows by its SMs: one series per split of the menu and the whole device (whole-GPU steps),
        # adding up to the multiplexer's counts
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        prefill = {s.labels["prefill_sms"]: s.value for s in samples if "prefill_sms" in s.labels}
        decode = {s.labels["decode_sms"]: s.value for s in samples if "decode_sms" in s.labels}
        assert set(prefill) == {"32", "64", "96", "132"} and set(decode) == {"36", "68", "100", "132"}
        assert sum(prefill.values()) == sum(stats["prefill_tokens_by_sms"].values()) > 0
        assert sum(decode.values()) == sum(stats["decode_rows_by_sms"].values()) > 0
        # the router's HTTP door on top of it
        body = {"model": "tiny-hybrid", "prompt": "hello there", "max_tokens": 5, "temperature": 0}
        answer = httpx.post(cluster.base_url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
    finally:
        cluster.stop()


def test_cli_has_the_flag_and_a_deployment_with_prefill_workers_is_refused(capsys: pytest.CaptureFixture) -> None:
    import hybridserve.cli as cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--pd-multiplex" in out and "--pd-multiplex-prefill-sms" in out
    engine = EngineConfig(pd_multiplex=True)
    with pytest.raises(ValueError, match="set --prefill-workers 0"):
        ServeOptions(router=RouterOptions("m"), worker=WorkerOptions("m", engine))
    assert ServeOptions(router=RouterOptions("m"), worker=WorkerOptions("m", engine), num_prefill=0).num_prefill == 0
