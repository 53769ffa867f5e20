"""`serve` / `up` / `worker` fail before starting anything when a flag is wrong: one line saying what to change,
exit code 2, no traceback, and no process left behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_process import free_port, processes_with

from hybridserve.deploy.preflight import (
    PreflightError,
    check_cluster_resources,
    check_gpus,
    check_model_dir,
    check_port_free,
    check_ray_reachable,
    gcs_endpoint,
)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridserve", *args], capture_output=True, text=True, timeout=timeout)


def _one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hybridserve: error: "), out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    return lines[0]


def test_missing_model_fails_at_once_in_one_line(tmp_path: Path) -> None:
    for command in (["serve", "--no-ray"], ["worker", "--role", "decode"], ["up", "--address", "127.0.0.1:1"]):
        start = time.monotonic()
        line = _one_line_error(_cli(*command, "--model", str(tmp_path / "nope")))
        assert time.monotonic() - start < 5, command  # before torch is even imported
        assert f"model directory {tmp_path / 'nope'} does not exist" in line and "--model" in line
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _one_line_error(_cli("serve", "--no-ray", "--model", str(tmp_path / "empty")))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert "not valid JSON" in _one_line_error(_cli("serve", "--no-ray", "--model", str(tmp_path / "bad")))


def test_port_in_use_fails_in_one_line_and_leaves_no_process(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        marker = str(tmp_path / "logs")
        line = _one_line_error(_cli("serve", "--no-ray", "--port", str(port), "--grpc-port", "0", "--log-dir", marker))
        assert f"port {port}" in line and "--port" in line
        line = _one_line_error(_cli("serve", "--no-ray", "--port", "0", "--grpc-port", str(port), "--log-dir", marker))
        assert "--grpc-port" in line
        line = _one_line_error(_cli("worker", "--role", "decode", "--port", str(port)))
        assert "--port" in line
    assert not processes_with(marker)
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_unreachable_ray_address_fails_naming_the_cause() -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    line = _one_line_error(_cli("up", "--address", f"127.0.0.1:{port}", "--timeout", "20"))
    assert time.monotonic() - start < 20
    assert f"no Ray cluster at 127.0.0.1:{port}" in line and "ray start --head" in line


def test_checks_name_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match="does not exist"):
        check_model_dir(str(tmp_path / "x"))
    (tmp_path / "f").write_text("")
    with pytest.raises(PreflightError, match="is a file"):
        check_model_dir(str(tmp_path / "f"))
    check_port_free("127.0.0.1", 0, "--port")  # 0: nothing to check
    with pytest.raises(PreflightError, match="no address of this host"):
        check_port_free("203.0.113.7", free_port(), "--port")
    check_gpus(0, 0, "--device cpu")
    with pytest.raises(PreflightError, match="shows none"):
        check_gpus(1, 0, "--device cuda")
    with pytest.raises(PreflightError, match="needs 4 GPUs, this host shows 2"):
        check_gpus(4, 2, "--tensor-parallel-size 2")
    assert gcs_endpoint("auto") is None and gcs_endpoint("10.0.0.1:6380") == ("10.0.0.1", 6380)
    assert gcs_endpoint("head") == ("head", 6379)
    with pytest.raises(PreflightError, match="not host:port"):
        gcs_endpoint("head:x")
    with pytest.raises(PreflightError, match="does not resolve"):
        check_ray_reachable("no-such-host.invalid:6379")


def test_cluster_resources_say_what_is_missing() -> None:
    offered = {"CPU": 8.0, "prefill": 1.0, "decode": 1.0}
    check_cluster_resources(offered, {"prefill": 1, "decode": 1, "CPU": 2, "GPU": 0})
    with pytest.raises(PreflightError, match=r"the cluster offers prefill: 1, this needs 2: start nodes with "
                                             r"`ray start --resources '\{\"prefill\": N\}'` or lower --prefill-workers"):
        check_cluster_resources(offered, {"prefill": 2, "decode": 1})
    with pytest.raises(PreflightError, match="the cluster offers GPU: 0, this needs 2"):
        check_cluster_resources(offered, {"prefill": 1, "GPU": 2})
