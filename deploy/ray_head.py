"""The local Ray head a bare `serve` (Ray, no --address) starts: `ray start --head --block` with the ports it
was given, as a child the launcher owns.

The launcher starts `python -m hybridserve.deploy.ray_head ...`, which runs `ray start --head --block` and
watches its standard input (deploy/parent_pipe.py): when the launcher exits in any way, or stops it, the
`ray start` process gets SIGTERM and takes the head's processes (GCS, raylet, dashboard agent, workers) with it
(Ray's own --block shutdown and reaper). Ports given as 0 are left to Ray (the GCS port: a free one chosen here,
so the address is known); the dashboard is off unless it is given a port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hybridserve.deploy.child_log import last_log_line
from hybridserve.deploy.parent_pipe import watch_parent_pipe

STOP_TIMEOUT_S = 30.0  # `ray start --block` stops its processes on SIGTERM; SIGKILL after this


@dataclass(frozen=True)
class RayHeadOptions:
    """Ports of the local Ray head `serve` starts without --address (0: Ray's choice, a free port)."""

    port: int = 0  # the head's GCS port (the cluster address); 0: a free one
    node_manager_port: int = 0  # the raylet's port; 0: a free one
    object_manager_port: int = 0  # the object manager's port; 0: a free one
    # the range Ray's worker processes (the worker actors) listen in; 0 and 0: Ray's default range (10002-19999)
    min_worker_port: int = 0
    max_worker_port: int = 0
    dashboard_port: int = 0  # the Ray dashboard's port; 0: no dashboard
    client_server_port: int = 0  # the Ray client server's port (ray://); 0: a free one
    metrics_export_port: int = 0  # the node's Prometheus metrics port; 0: a free one
    dashboard_agent_listen_port: int = 0  # the dashboard agent's HTTP port (it runs without the dashboard too)
    dashboard_agent_grpc_port: int = 0  # the dashboard agent's gRPC port; 0: a free one
    runtime_env_agent_port: int = 0  # the runtime-env agent's port; 0: a free one

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or not (value == 0 or 1024 <= value <= 65535):
                raise ValueError(f"--ray-{f.name.replace('_', '-')} must be 0 (Ray's choice) or a port in "
                                 f"1024..65535, got {value!r}")
        low, high = self.min_worker_port, self.max_worker_port
        if (low or high) and low >= high:
            raise ValueError(f"--ray-min-worker-port and --ray-max-worker-port give a range low < high (both 0: "
                             f"Ray's default), got {low}..{high}")
        given = [p for p in self.fixed_ports() if p]
        if len(given) != len(set(given)):
            raise ValueError(f"the Ray head's ports must differ, got {sorted(given)}")
        if low and any(low <= p <= high for p in given):
            raise ValueError(f"the Ray head's ports {sorted(given)} must lie outside its worker range {low}..{high}")

    def fixed_ports(self) -> list[int]:
        """The single ports given (not the worker range), 0 for those left to Ray."""
        return [self.port, self.node_manager_port, self.object_manager_port, self.dashboard_port,
                self.client_server_port, self.metrics_export_port, self.dashboard_agent_listen_port,
                self.dashboard_agent_grpc_port, self.runtime_env_agent_port]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_args(options: RayHeadOptions, gcs_port: int, resources: dict[str, float], num_cpus: int,
               temp_dir: str) -> list[str]:
    """The `ray start` arguments of the head (after `ray start`)."""
    args = ["--head", "--block", "--disable-usage-stats", "--port", str(gcs_port), "--num-cpus", str(num_cpus),
            "--resources", json.dumps(resources), "--temp-dir", temp_dir]
    named = {"node_manager_port": "--node-manager-port", "object_manager_port": "--object-manager-port",
             "min_worker_port": "--min-worker-port", "max_worker_port": "--max-worker-port",
             "metrics_export_port": "--metrics-export-port",
             "dashboard_agent_listen_port": "--dashboard-agent-listen-port",
             "dashboard_agent_grpc_port": "--dashboard-agent-grpc-port",
             "runtime_env_agent_port": "--runtime-env-agent-port"}
    for name, flag in named.items():
        if getattr(options, name):
            args += [flag, str(getattr(options, name))]
    args += ["--ray-client-server-port", str(options.client_server_port or _free_port())]
    if options.dashboard_port:
        args += ["--include-dashboard", "true", "--dashboard-port", str(options.dashboard_port)]
    else:
        args += ["--include-dashboard", "false"]
    return args


class RayHead:
    """A running head (the launcher's child); `address` is its GCS address."""

    def __init__(self, process: subprocess.Popen, address: str, temp_dir: str, log_path: Path) -> None:
        self.process = process
        self.address = address
        self.temp_dir = temp_dir
        self.log_path = log_path

    @classmethod
    def start(cls, options: RayHeadOptions, resources: dict[str, float], num_cpus: int,
              timeout_s: float) -> RayHead:
        """Start the head and wait until its GCS port answers (at most `timeout_s`); RuntimeError with the last
        line of its log when it exits first or the deadline passes."""
        gcs_port = options.port or _free_port()
        temp_dir = tempfile.mkdtemp(prefix="hsray-")  # short: Ray puts Unix sockets under it
        log_path = Path(temp_dir) / "head.log"
        argv = [sys.executable, "-m", "hybridserve.deploy.ray_head",
                *start_args(options, gcs_port, resources, num_cpus, temp_dir)]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # Ctrl-C reaches the launcher, which stops it
        head = cls(process, f"127.0.0.1:{gcs_port}", temp_dir, log_path)
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                why = head.log_tail()
                head.stop()
                raise RuntimeError(f"the local Ray head exited with status {process.returncode}: {why}")
            try:
                with socket.create_connection(("127.0.0.1", gcs_port), timeout=1.0):
                    return head
            except OSError:
                pass
            if time.monotonic() > deadline:
                why = head.log_tail()
                head.stop()
                raise RuntimeError(f"the local Ray head did not answer on port {gcs_port} within {timeout_s:.0f} s"
                                   f"{f': {why}' if why else ''}; raise --timeout")
            time.sleep(0.1)

    def log_tail(self) -> str:
        return last_log_line(self.log_path)

    def stop(self) -> None:
        """Stop the head and its processes (SIGTERM, SIGKILL after STOP_TIMEOUT_S); remove its temp dir."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # the whole session: the wrapper, `ray start` and the head's processes
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def main(args: list[str]) -> int:
    """The child: `ray start <args>` until standard input closes (the launcher is gone) or SIGTERM / SIGINT."""
    ray_start = subprocess.Popen([sys.executable, "-c", "import sys; from ray.scripts.scripts import main; "
                                  "sys.argv[0] = 'ray'; main()", "start", *args], stdin=subprocess.DEVNULL)

    def stop(_signum: int, _frame: object) -> None:
        if ray_start.poll() is None:
            ray_start.terminate()  # --block: Ray stops the head's processes on SIGTERM

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    watch_parent_pipe()  # SIGTERMs this process when the launcher's end of the pipe closes
    try:
        return ray_start.wait(timeout=None)
    finally:
        if ray_start.poll() is None:
            ray_start.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
