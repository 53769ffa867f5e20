"""The deploy/ manifests: YAML / JSON that parses, KubeRay objects valid against the CRD schemas, and a
Grafana dashboard whose queries only name series the router's and workers' metric registries expose."""

from __future__ import annotations

import collections
import json
import re
import types
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CRDS = DEPLOY / "kuberay" / "crds"  # KubeRay's RayCluster CRD, vendored (Apache-2.0, see NOTICE there)


def _yaml_docs(path: Path) -> list[dict]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the vendored CRD is ~1 MB of YAML
    return [d for d in yaml.load_all(path.read_text(), Loader=loader) if d is not None]


class _IdleLoop:
    """Stands in for a worker's engine loop: every sampled engine statistic reads 0, and the engine runs
    speculative decoding (two draft positions) so that its counters are exported too."""

    def __init__(self) -> None:
        from hybridserve.worker_runtime.loop_stats import LoopStats

        self.stats = LoopStats("idle")

    def call(self, fn, timeout: float | None = None) -> tuple[dict, types.SimpleNamespace, None]:
        spec = types.SimpleNamespace(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                                     accepted_per_position=[0, 0])
        return collections.defaultdict(float), spec, None  # no pd-multiplex lanes: their families at 0


def _exported_metrics() -> set[str]:
    """Every series name the router's and a worker's /metrics expose, from their real registries."""
    from prometheus_client import generate_latest

    from hybridserve.router.metrics import RouterMetrics
    from hybridserve.worker_runtime.worker_metrics import WorkerMetrics

    names = set()
    for registry in (RouterMetrics().registry, WorkerMetrics(_IdleLoop(), "decode").registry):
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                names.update([f"{name}_bucket", f"{name}_sum", f"{name}_count"] if kind == "histogram" else [name])
    assert names, "no metrics exported"
    return names


def _crd_schema(kind: str) -> dict:
    for path in sorted(CRDS.glob("*.yaml")):
        for doc in _yaml_docs(path):
            if doc.get("kind") == "CustomResourceDefinition" and doc["spec"]["names"]["kind"] == kind:
                version = next(v for v in doc["spec"]["versions"] if v["name"] == "v1")
                return version["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD for {kind} in {CRDS}")


def test_every_manifest_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 7
    for path in files:
        assert _yaml_docs(path), path
    json.loads((DEPLOY / "grafana" / "hybridserve.json").read_text())


def test_kustomization_lists_existing_files() -> None:
    kustomization = _yaml_docs(DEPLOY / "kuberay" / "kustomization.yaml")[0]
    for resource in kustomization["resources"]:
        assert (DEPLOY / "kuberay" / resource).is_file(), resource


def test_raycluster_validates_against_crd() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    cluster = _yaml_docs(DEPLOY / "kuberay" / "raycluster.yaml")[0]
    assert cluster["kind"] == "RayCluster"
    jsonschema.validate(cluster, _crd_schema("RayCluster"))
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, group in groups.items():
        assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {role: 1}
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert not any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in head)
    up = next(c for c in head if "hybridserve up" in " ".join(c.get("args", [])))
    assert up["readinessProbe"]["httpGet"]["path"] == "/ready" and up["livenessProbe"]["httpGet"]["path"] == "/health"


def test_every_ray_pod_mounts_the_internal_tls_secret_and_up_uses_it() -> None:
    """The router actor (head) and every worker actor read the certificate where `up` says it is."""
    cluster = _yaml_docs(DEPLOY / "kuberay" / "raycluster.yaml")[0]
    specs = [cluster["spec"]["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]]
    for spec in specs:
        volume = next(v["name"] for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "hybridserve-internal-tls")
        ray_container = next(c for c in spec["containers"] if c["name"] in ("ray-head", "ray-worker"))
        mounts = {m["name"]: m["mountPath"] for m in ray_container["volumeMounts"]}
        assert mounts[volume] == "/etc/hybridserve/tls"
    up = " ".join(next(c for c in specs[0]["containers"] if "hybridserve up" in " ".join(c.get("args", [])))["args"])
    for flag, key in (("ca-file", "ca.crt"), ("cert-file", "tls.crt"), ("key-file", "tls.key")):
        assert f"--internal-tls-{flag} /etc/hybridserve/tls/{key}" in up


def test_ray_cluster_launcher_node_types() -> None:
    config = _yaml_docs(DEPLOY / "ray" / "cluster.yaml")[0]
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"].get("CPU") == 0
    assert types["prefill"]["resources"] == {"prefill": 1} and types["decode"]["resources"] == {"decode": 1}


def test_prometheus_uses_router_http_sd() -> None:
    config = _yaml_docs(DEPLOY / "prometheus" / "prometheus.yml")[0]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["hybridserve"]["http_sd_configs"][0]["url"].endswith("/targets")
    assert "ray" in jobs


def test_grafana_queries_name_defined_metrics() -> None:
    exported = _exported_metrics()
    dashboard = json.loads((DEPLOY / "grafana" / "hybridserve.json").read_text())
    used = set()
    for panel in dashboard["panels"]:
        if panel["type"] == "row":  # a section header: no queries
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = re.findall(r"hybridserve_\w+", target["expr"])
            assert names, target["expr"]
            used.update(names)
    assert not used - exported, f"queries name metrics the code does not export: {sorted(used - exported)}"
    for wanted in ("time_to_first_token", "inter_token", "transfer_bytes", "kv_cache_usage", "state_slot_usage",
                   "routing_decisions", "prefix_cache_hits", "queued_requests", "spec_accepted_tokens",
                   "spec_draft_tokens", "spec_verify_steps", "spec_accepted_by_position", "pd_multiplex_prefill_sms",
                   "pd_multiplex_split_changes"):
        assert any(wanted in name for name in used), wanted


def test_kuberay_gpu_counts_follow_the_tensor_parallel_size() -> None:
    """kustomization.yaml's TENSOR_PARALLEL_SIZE reaches `hybridserve up`, and its GPU patches give each worker
    pod that many GPUs."""
    kustomization = _yaml_docs(DEPLOY / "kuberay" / "kustomization.yaml")[0]
    literals = dict(item.split("=", 1) for item in kustomization["configMapGenerator"][0]["literals"])
    size = literals["TENSOR_PARALLEL_SIZE"]
    ops = yaml.safe_load(kustomization["patches"][0]["patch"])
    gpu_ops = [op for op in ops if op["path"].endswith("nvidia.com~1gpu")]
    assert len(gpu_ops) == 4 and all(op["value"] == size for op in gpu_ops)
    cluster = _yaml_docs(DEPLOY / "kuberay" / "raycluster.yaml")[0]
    for op in gpu_ops:  # each patched path exists in the RayCluster
        node: object = cluster["spec"]
        for part in op["path"].split("/")[2:]:
            key = part.replace("~1", "/")
            node = node[int(key)] if isinstance(node, list) else node[key]  # type: ignore[index]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    up = next(c for c in head if "hybridserve up" in " ".join(c.get("args", [])))
    assert '--tensor-parallel-size "$TENSOR_PARALLEL_SIZE"' in " ".join(up["args"])
