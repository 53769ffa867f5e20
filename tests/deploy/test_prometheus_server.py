"""A real Prometheus server against a real deployment: `deploy/prometheus/install_prometheus.sh` installs
prometheus and promtool, promtool accepts the shipped config (and any rule files), a prometheus process
discovers the router and both workers through the router's http_sd list `/targets` exactly as the shipped
config does, scrapes them all (`up == 1`, request counters move after completions), and every PromQL
expression of the Grafana dashboard parses and evaluates on it."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "hybridserve.json"
INSTALL = PROM_DIR / "install_prometheus.sh"
NO_APT_EXIT = 3  # install_prometheus.sh: no apt-get on this machine

from router_cluster import ENGINE, MODEL_NAME, Cluster, tiny_model_dir  # noqa: E402  (the router tests' cluster)

INSTALL_TIMEOUT_S = 900
STARTUP_TIMEOUT_S = 30
SCRAPE_TIMEOUT_S = 60
HTTP_TIMEOUT_S = 10
# Grafana's built-in interval variables, for evaluating dashboard expressions outside Grafana
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
# workers speculate with n-gram drafts, so the speculative-decoding panels see real series; a prompt holding
# every non-special token id makes each generated token match it, hence drafts at every decode step
SPEC_ENGINE = dataclasses.replace(ENGINE, max_model_len=512,
                                  speculative_config={"method": "ngram", "num_speculative_tokens": 2})
PROMPT_IDS = list(range(3, 320))  # the tiny model's vocabulary; 0-2 are pad / bos / eos


@pytest.fixture(scope="module")
def prom_bins() -> dict[str, str]:
    """{"prometheus": path, "promtool": path}, installed by the project's script when missing."""
    try:
        done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"install_prometheus.sh did not finish in {INSTALL_TIMEOUT_S} s: {exc.stderr!s:.2000}")
    if done.returncode == NO_APT_EXIT:
        pytest.skip(f"cannot install prometheus: {done.stderr.strip()}")
    assert done.returncode == 0, f"install_prometheus.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    bins = {name: shutil.which(name) for name in ("prometheus", "promtool")}
    assert all(bins.values()), f"installed but not on PATH: {bins}"
    return bins


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _promtool(promtool: str, *args: str) -> None:
    done = subprocess.run([promtool, "check", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"promtool check {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


def _shipped_config() -> dict:
    return yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())


def _rule_files(config: dict) -> list[Path]:
    """The rule files the config names (globs relative to deploy/prometheus/)."""
    files = []
    for pattern in config.get("rule_files") or []:
        matches = sorted(PROM_DIR.glob(pattern)) if not Path(pattern).is_absolute() else [Path(pattern)]
        assert matches, f"rule_files pattern {pattern} matches nothing"
        files += matches
    return files


def _local_config(router_address: str) -> dict:
    """The shipped config with only what a local run must change: second-scale intervals, the router's
    address in the http_sd URL, absolute rule-file paths, and no `ray` job (no Ray cluster here)."""
    config = _shipped_config()
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "hybridserve")
    (sd,) = job["http_sd_configs"]
    sd.update(url=re.sub(r"^http://[^/]+", f"http://{router_address}", sd["url"]), refresh_interval="1s")
    config["scrape_configs"] = [job]
    if config.get("rule_files"):
        config["rule_files"] = [str(p) for p in _rule_files(config)]
    return config


def _dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard (row panels carry none), Grafana variables substituted."""
    exprs = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            exprs.append(expr)
    return exprs


class PromQLError(RuntimeError):
    """Prometheus answered a query with an error (parse or evaluation)."""


class _Prometheus:
    """A prometheus server process on a free loopback port with its own TSDB in a temporary directory."""

    def __init__(self, binary: str, config: dict, workdir: Path) -> None:
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = workdir / "prometheus.log"
        self.url = f"http://127.0.0.1:{_free_port()}"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited with {self.proc.returncode}:\n{self.log()}"
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready in {timeout} s:\n{self.log()}")

    def query(self, expr: str) -> list[dict]:
        """The instant-query result; an expression Prometheus rejects fails with its error message."""
        body = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=HTTP_TIMEOUT_S).json()
        if body.get("status") != "success":
            raise PromQLError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def metric_names(self) -> set[str]:
        body = httpx.get(self.url + "/api/v1/label/__name__/values", timeout=HTTP_TIMEOUT_S).json()
        return set(body["data"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def _by_label(result: list[dict], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


def test_promtool_accepts_shipped_config_and_rules(prom_bins) -> None:
    _promtool(prom_bins["promtool"], "config", str(PROM_DIR / "prometheus.yml"))
    rules = _rule_files(_shipped_config())
    if rules:
        _promtool(prom_bins["promtool"], "rules", *map(str, rules))


def test_prometheus_scrapes_deployment_and_evaluates_dashboard(prom_bins) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="hybridserve-prometheus-"))
    cluster: Cluster | None = None
    prom: _Prometheus | None = None
    try:
        cluster = Cluster(tiny_model_dir(), num_prefill=1, num_decode=1, engine=SPEC_ENGINE)
        config = _local_config(cluster.router.http_address)
        prom = _Prometheus(prom_bins["prometheus"], config, workdir)
        _promtool(prom_bins["promtool"], "config", str(prom.config_path))
        prom.wait_ready(STARTUP_TIMEOUT_S)

        for i in range(2):
            reply = httpx.post(cluster.base_url + "/v1/completions", timeout=60, json={
                "model": MODEL_NAME, "prompt": PROMPT_IDS[i:], "max_tokens": 6, "temperature": 0})
            assert reply.status_code == 200, reply.text

        # every discovered target up, and the request counters of router and both workers moved
        wanted = {
            'up{job="hybridserve"}': ("component", {"router", "prefill_worker", "decode_worker"}),
            'sum by (component) (hybridserve_router_requests_total{endpoint="/v1/completions",status="200"})':
                ("component", {"router"}),
            "sum by (role) (hybridserve_worker_requests_total)": ("role", {"prefill", "decode"}),
            "sum by (role) (hybridserve_worker_spec_draft_tokens_total > 0)": ("role", {"decode"}),
            # the two named queries: state bytes moved prefill -> decode, and time to first token
            "sum by (role) (hybridserve_worker_transfer_bytes_total > 0)": ("role", {"prefill"}),
            "sum by (component) (hybridserve_router_time_to_first_token_seconds_count > 0)": ("component", {"router"}),
            # two samples of router and worker counters, so that the dashboard's rate() windows hold data
            "sum by (component) (rate(hybridserve_router_generation_tokens_total[1m]) >= 0)": ("component", {"router"}),
            "sum by (role) (rate(hybridserve_worker_generation_tokens_total[1m]) >= 0)":
                ("role", {"prefill", "decode"}),
        }
        seen: dict[str, dict[str, float]] = {}
        deadline = time.monotonic() + SCRAPE_TIMEOUT_S
        while True:
            assert prom.proc.poll() is None, f"prometheus exited:\n{prom.log()}"
            seen = {expr: _by_label(prom.query(expr), label) for expr, (label, _) in wanted.items()}
            # each expected label value present, and positive (rates: present, i.e. two samples scraped)
            if all(set(seen[e]) == keys and all(v > 0 or "rate(" in e for v in seen[e].values())
                   for e, (_, keys) in wanted.items()):
                break
            assert time.monotonic() < deadline, f"not scraped in {SCRAPE_TIMEOUT_S} s: {seen}\n{prom.log()}"
            time.sleep(0.5)
        assert seen['up{job="hybridserve"}'] == {"router": 1.0, "prefill_worker": 1.0, "decode_worker": 1.0}
        targets = httpx.get(prom.url + "/api/v1/targets", timeout=HTTP_TIMEOUT_S).json()["data"]["activeTargets"]
        assert all(t["health"] == "up" for t in targets), targets

        # every dashboard expression parses and evaluates; one whose series all exist must return data
        present = prom.metric_names()
        failures, empty = [], []
        for expr in _dashboard_exprs():
            try:
                result = prom.query(expr)
            except PromQLError as exc:
                failures.append(str(exc))
                continue
            if not result and set(re.findall(r"hybridserve_\w+", expr)) <= present:
                empty.append(expr)
        assert not failures, "dashboard queries Prometheus rejects:\n" + "\n".join(failures)
        assert not empty, "dashboard queries over scraped series that return nothing:\n" + "\n".join(empty)
    finally:
        if prom is not None:
            prom.stop()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
