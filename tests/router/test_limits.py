"""Per-client limits: a client past max_per_client concurrent requests gets 429 with an OpenAI error body,
while another client (another API key) is still admitted; counts return to zero."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from router_cluster import MODEL_NAME, Cluster

from hybridserve.router.admission import AdmissionController, Overloaded, client_key
from hybridserve.router.config import AdmissionConfig


def test_admission_counts_each_client_separately() -> None:
    admission = AdmissionController(AdmissionConfig(max_running=4, max_queued=0, max_per_client=2))
    a, b = client_key("Bearer a", "10.0.0.1"), client_key(None, "10.0.0.1")
    assert admission.try_acquire(a) and admission.try_acquire(a)
    with pytest.raises(Overloaded) as refused:
        admission.try_acquire(a)
    assert refused.value.queue_full  # 429
    with pytest.raises(Overloaded):
        admission.acquire(client=a)
    admission.acquire(client=b)
    admission.release(a)
    assert admission.try_acquire(a)
    for client in (a, a, b):
        admission.release(client)
    assert admission.running == 0 and not admission._per_client


@pytest.fixture(scope="module")
def limited(model_dir):
    c = Cluster(model_dir, num_prefill=0, num_decode=1, api_key=None,
                admission=AdmissionConfig(max_per_client=1))
    step = c.decode[0].engine.step

    def slow_step(**kw):  # type: ignore[no-untyped-def]  # the first stream is still running when the second comes
        time.sleep(0.02)
        return step(**kw)

    c.decode[0].engine.step = slow_step
    yield c
    c.stop()


def test_a_second_concurrent_stream_of_one_client_gets_429(limited) -> None:
    body = {"model": MODEL_NAME, "prompt": "limit me", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}
    opened = threading.Event()
    lines: list[str] = []

    def first() -> None:
        with httpx.stream("POST", limited.base_url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                opened.set()
                lines.append(line)

    thread = threading.Thread(target=first)
    thread.start()
    assert opened.wait(30)
    second = httpx.post(limited.base_url + "/v1/completions", json={**body, "stream": False}, timeout=30)
    assert second.status_code == 429
    error = second.json()["error"]
    assert "limit per client" in error["message"] and error["code"] == "overloaded"
    thread.join(timeout=60)
    assert lines[-1] == "data: [DONE]" or lines[-1] == ""
    done = httpx.post(limited.base_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=30)
    assert done.status_code == 200
    assert limited.router.frontend.admission.running == 0
