"""A fresh system exposes every series the Grafana dashboard queries, at 0, before any request; and the label
values the router pre-creates are the ones its code uses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_cluster import Cluster, tiny_model_dir

from hybridserve.router import metrics as router_metrics
from hybridserve.router.policy import REASONS

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "hybridserve.json"


def _names(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(tiny_model_dir())
    yield c
    c.stop()


def test_every_dashboard_series_exists_at_zero_on_a_fresh_system(cluster) -> None:
    queried = set(re.findall(r"hybridserve_[a-z_]+", json.dumps(json.load(DASHBOARD.open()))))
    assert queried, "the dashboard queries no hybridserve series?"
    series = _names(cluster.base_url + "/metrics")
    targets = httpx.get(cluster.base_url + "/targets", timeout=10).json()
    for group in targets:
        if group["labels"]["component"] != "router":
            series.update(_names(f"http://{group['targets'][0]}/metrics"))
    missing = sorted(q for q in queried if q not in series)
    assert not missing, f"a fresh system lacks these dashboard series: {missing}"
    counters = [q for q in queried if q.endswith("_total")]
    assert all(series[q] == 0 for q in counters), {q: series[q] for q in counters if series[q]}


def test_pre_created_label_values_match_the_code() -> None:
    assert {reason for _, reason in router_metrics.ROUTES} == set(REASONS)
    source = (Path(router_metrics.__file__).parent / "orchestrator.py").read_text()
    stages = set(re.findall(r'self\._(?:call|first)\([^"]*"([a-z_]+)"', source))
    assert stages and stages <= set(router_metrics.RETRY_STAGES)
