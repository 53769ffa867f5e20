"""The local Ray head a bare `serve` starts (deploy/ray_head.py): Ray gets the ports it was given (GCS, raylet,
object manager, worker range, metrics, agents; dashboard off), and the head's processes end when the launcher is
SIGKILLed (a stopped `serve` ending its head: tests/transfer/test_processes_and_ray.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from serve_process import free_port, processes_with, wait_gone

from hybridserve.deploy.ray_head import RayHeadOptions, start_args

LAUNCHER = textwrap.dedent("""
    import json, sys, time
    import ray
    from hybridserve.deploy.ray_head import RayHead, RayHeadOptions
    head = RayHead.start(RayHeadOptions(**json.loads(sys.argv[1])), {"prefill": 1, "decode": 1}, 1, 240)
    ray.init(address=head.address, log_to_driver=False)
    node = ray.nodes()[0]
    print(json.dumps({"address": head.address, "temp_dir": head.temp_dir, "raylet": node["NodeManagerPort"],
                      "objects": node["ObjectManagerPort"], "metrics": node["MetricsExportPort"],
                      "resources": node["Resources"]}), flush=True)
    time.sleep(600)
""")


def test_ports_are_checked_on_construction() -> None:
    with pytest.raises(ValueError, match="--ray-port must be 0"):
        RayHeadOptions(port=80)
    with pytest.raises(ValueError, match="low < high"):
        RayHeadOptions(min_worker_port=20000)
    with pytest.raises(ValueError, match="must differ"):
        RayHeadOptions(port=20000, node_manager_port=20000)
    with pytest.raises(ValueError, match="outside its worker range"):
        RayHeadOptions(port=20005, min_worker_port=20000, max_worker_port=20010)
    args = start_args(RayHeadOptions(node_manager_port=20001), 20000, {"decode": 1}, 2, "/tmp/x")
    assert args[:5] == ["--head", "--block", "--disable-usage-stats", "--port", "20000"]
    assert ["--node-manager-port", "20001"] == args[args.index("--node-manager-port"):][:2]
    assert "--object-manager-port" not in args and args[-2:] == ["--include-dashboard", "false"]


def _gcs_answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_the_head_takes_its_ports_and_ends_with_its_sigkilled_launcher(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    low = free_port()
    high = low + 16  # the range is checked in the raylet's argv
    ports: dict[str, int] = {}
    for name in ("port", "node_manager_port", "object_manager_port", "metrics_export_port", "client_server_port",
                 "dashboard_agent_listen_port", "dashboard_agent_grpc_port", "runtime_env_agent_port"):
        port = free_port()
        while low <= port <= high or port in ports.values():
            port = free_port()
        ports[name] = port
    ports.update(min_worker_port=low, max_worker_port=high)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, json.dumps(ports)], stdout=subprocess.PIPE,
                                stderr=open(tmp_path / "launcher.log", "w"), text=True)  # noqa: SIM115
    try:
        line = launcher.stdout.readline() if launcher.stdout else ""
        assert line, (tmp_path / "launcher.log").read_text()[-3000:]
        found = json.loads(line)
        assert found["address"] == f"127.0.0.1:{ports['port']}"
        assert (found["raylet"], found["objects"], found["metrics"]) == (
            ports["node_manager_port"], ports["object_manager_port"], ports["metrics_export_port"])
        assert found["resources"]["prefill"] == 1 and found["resources"]["decode"] == 1
        head_processes = processes_with(found["temp_dir"])
        raylet = [pid for pid in head_processes if b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert raylet, "no raylet among the head's processes"
        argv = Path(f"/proc/{raylet[0]}/cmdline").read_bytes().decode()
        assert f"--min_worker_port={low}" in argv and f"--max_worker_port={high}" in argv
        os.kill(launcher.pid, signal.SIGKILL)
        assert wait_gone(head_processes, 60) == []
        assert not _gcs_answers(found["address"])
    finally:
        launcher.kill()
        launcher.wait(30)
