"""The router warms its serving path before it reports ready (router/path_warmup.py): one one-token request per
door, end to end; the warm-up is not traffic (every router series starts at 0); readiness waits for it."""

from __future__ import annotations

import logging

import httpx
import pytest
from router_cluster import Cluster, tiny_model_dir

from hybridserve.router.path_warmup import warm_serving_path


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir()


def _series(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name + str(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("hybridserve_router_requests_total")}


def test_start_warms_each_door_and_reports_ready_after(model_dir) -> None:
    cluster = Cluster(model_dir, num_prefill=0, num_decode=1)
    try:
        (handle,) = cluster.orchestrator.workers.all()
        assert handle._session is not None, "the warm-up request should have opened the worker's session"
        assert all(v == 0 for v in _series(cluster.base_url).values())  # warm-up requests are not counted
        ready = httpx.get(cluster.base_url + "/ready", timeout=10)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        cluster.router.frontend.path_warm = False  # what /ready says while Router.start warms the path
        warming = httpx.get(cluster.base_url + "/ready", timeout=10)
        assert warming.status_code == 503 and warming.json()["status"] == "warming_up"
        cluster.router.frontend.path_warm = True
        reply = httpx.post(cluster.base_url + "/v1/completions", timeout=30,
                           json={"model": "tiny-hybrid", "prompt": [5, 6, 7], "max_tokens": 2})
        assert reply.status_code == 200
        counted = _series(cluster.base_url)
        assert sum(counted.values()) == 1  # the user's request, and only it
    finally:
        cluster.stop()


def test_warm_up_off_leaves_the_session_to_the_first_request(model_dir) -> None:
    cluster = Cluster(model_dir, num_prefill=0, num_decode=1, warm_up_path=False)
    try:
        (handle,) = cluster.orchestrator.workers.all()
        assert handle._session is None
        assert httpx.get(cluster.base_url + "/ready", timeout=10).status_code == 200
    finally:
        cluster.stop()


def test_a_door_that_fails_its_warm_up_is_logged_not_raised(caplog) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="hybridserve.router.path_warmup"):
        took = warm_serving_path(f"127.0.0.1:{port}", f"127.0.0.1:{port}", "m", None)
    assert took == {}
    assert sum("warming the" in r.getMessage() for r in caplog.records) == 2
