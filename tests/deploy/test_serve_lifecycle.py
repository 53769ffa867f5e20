"""`serve --no-ray` owns its workers: every way out (an error after the workers started, Ctrl-C during
start-up, a SIGKILL of the launcher) ends them; a SIGKILLed worker is restarted and serves again; a frozen
worker turns /ready false."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from checkpoints import nemotron_h
from serve_process import ServeProcess, children, processes_with, wait_gone

from hybridserve.deploy import serve as serve_module
from hybridserve.deploy.options import ServeOptions, WorkerOptions
from hybridserve.engine.config import EngineConfig
from hybridserve.router.config import RouterOptions

ENGINE = EngineConfig(max_num_seqs=4, max_model_len=256, cpu_memory_gb=0.05, warmup=False)


def _worker_pids(launcher: int) -> list[int]:
    return children(launcher)


def test_failure_after_the_workers_started_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's port is taken between the pre-flight check and its bind (here: the check is skipped):
    the workers already started are stopped, their ready files removed."""
    model_dir, _ = nemotron_h("M*-M")
    monkeypatch.setattr(serve_module, "preflight", lambda options: None)
    earlier = set(children(os.getpid()))  # this process's children from other tests are not this serve's
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log_dir = tmp_path / "logs"
        options = ServeOptions(router=RouterOptions(model_dir=str(model_dir), http_port=port, grpc_port=0),
                               worker=WorkerOptions(str(model_dir), ENGINE), num_prefill=0, num_decode=1,
                               use_ray=False, log_dir=str(log_dir))
        scratch = tmp_path / "scratch"  # where the launcher's ready files go (tempfile's directory)
        scratch.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(scratch))
        with pytest.raises(Exception):  # noqa: B017 - whatever the bind raises; the point is what is left
            serve_module.serve(options)
    assert (log_dir / "decode-0.log").is_file()  # the worker did start
    started = [pid for pid in children(os.getpid()) if pid not in earlier]
    assert not wait_gone(processes_with(str(log_dir)) + started, 30)
    assert not list(scratch.glob("hybridserve-ready-*"))


def test_ctrl_c_during_start_up_stops_cleanly(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "serve.log", "--prefill-workers", "0")
    try:
        server.wait_for(r"worker logs in")
        time.sleep(1.0)  # the worker is loading
        workers = _worker_pids(server.proc.pid)
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=60) == 130
        out = server.output()
        assert "interrupted (SIGINT)" in out and "Traceback" not in out and "SIGTERM" not in out, out
        assert not wait_gone(workers, 30)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir, _ = nemotron_h("M*-M")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = ServeProcess(log, "--model", str(model_dir), "--prefill-workers", "1",
                          "--max-num-seqs", "4", "--max-model-len", "256", "--cpu-memory-gb", "0.05")
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()


def _decode_pid(server: ServeProcess) -> int:
    pids = [pid for pid in _worker_pids(server.proc.pid)
            if b"--role\0decode" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(pids) == 1, pids
    return pids[0]


def _wait_ready(server: ServeProcess, want: bool, timeout_s: float) -> float:
    """Seconds until /ready is `want` (fails after `timeout_s`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if (server.ready().status_code == 200) == want:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"/ready did not turn {want} in {timeout_s} s: {server.ready().text}\n{server.output()[-2000:]}")


def test_a_frozen_worker_turns_ready_false(server: ServeProcess) -> None:
    assert server.ready().status_code == 200 and server.complete().status_code == 200
    pid = _decode_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_ready(server, False, 10)
        body = server.ready().json()
        assert body["healthy_workers"]["decode"] == 0 and "health unanswered" in str(body["unhealthy_workers"]), body
    finally:
        os.kill(pid, signal.SIGCONT)
    _wait_ready(server, True, 30)
    assert server.complete().status_code == 200


def test_a_killed_worker_is_restarted_and_serves(server: ServeProcess) -> None:
    pid = _decode_pid(server)
    os.kill(pid, signal.SIGKILL)
    _wait_ready(server, False, 10)
    _wait_ready(server, True, 30)
    assert _decode_pid(server) != pid
    reply = server.complete()
    assert reply.status_code == 200, reply.text
    assert "restarting it in" in server.output() and "decode worker decode-0 is back" in server.output()


def test_sigkill_of_the_launcher_ends_its_workers(server: ServeProcess) -> None:
    workers = _worker_pids(server.proc.pid)
    assert len(workers) == 2
    server.proc.kill()
    server.proc.wait(timeout=30)
    assert not wait_gone(workers, 30)


def test_a_clean_stop_logs_no_warning_and_ends_with_stopped(tmp_path: Path) -> None:
    model_dir, _ = nemotron_h("M*-M")
    server = ServeProcess(tmp_path / "serve.log", "--model", str(model_dir), "--prefill-workers", "1",
                          "--max-num-seqs", "4", "--max-model-len", "256", "--cpu-memory-gb", "0.05")
    try:
        server.wait_serving()
        banner = server.output().strip().splitlines()
        assert banner[-1].startswith("hybridserve: send requests to grpc://"), banner
        assert banner[-1].endswith(f"http://127.0.0.1:{server.http_port}/v1"), banner
        assert not any("PLAINTEXT" in line or "INSECURE" in line or "WARNING" in line for line in banner), banner
        workers = _worker_pids(server.proc.pid)
        assert server.complete().status_code == 200
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=120) == 0
        lines = server.output().strip().splitlines()
        assert lines[-1] == "hybridserve: stopped", lines[-5:]
        assert any("draining (SIGINT)" in line for line in lines), lines[-5:]
        assert not [line for line in lines if "WARNING" in line or "Traceback" in line], lines
        assert not wait_gone(workers, 30)
        worker_log = (tmp_path / "workers" / "decode-0.log").read_text()
        assert "INFO" in worker_log and "stopped" in worker_log, worker_log[-2000:]
    finally:
        server.stop()


def test_serve_option_timeout_and_port_base_are_validated() -> None:
    model_dir, _ = nemotron_h("M*-M")
    base = ServeOptions(router=RouterOptions(model_dir=str(model_dir)), worker=WorkerOptions(str(model_dir), ENGINE))
    with pytest.raises(ValueError, match="--timeout"):
        dataclasses.replace(base, timeout_s=0)
    with pytest.raises(ValueError, match="--worker-port-base"):
        dataclasses.replace(base, worker_port_base=65534)
