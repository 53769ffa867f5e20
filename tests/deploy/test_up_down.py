"""`hybridserve up` / `down` on a real three-node Ray cluster on this machine (a head plus a `prefill` node and
a `decode` node): actors land on the nodes with their resource, HTTP answers with the offline tokens, a
killed decode worker is restarted and later requests succeed, re-running `up` reuses the actors or scales
them, `down` removes every actor."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from checkpoints import nemotron_h

from hybridserve import LLM, SamplingParams

ray = pytest.importorskip("ray")

STEP_TIMEOUT_S = 240
NODE_TIMEOUT_S = 120
PROMPT = list(range(30, 60))
PARAMS = SamplingParams(max_tokens=5, temperature=0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray head exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"ray head did not listen on {port} within {timeout}s")


def _start_node(args: list[str], log: Path) -> subprocess.Popen:
    """`ray start --block` in its own process group, so the test stops exactly the processes it started."""
    with open(log, "w") as out:
        # this interpreter's `ray`: the cluster's workers import this checkout's hybridserve, not another install
        ray_cli = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"]
        return subprocess.Popen([*ray_cli, "start", "--block", "--disable-usage-stats", *args], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop_nodes(procs: list[subprocess.Popen]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass


def _cli(*args: str, timeout: float = STEP_TIMEOUT_S) -> str:
    result = subprocess.run([sys.executable, "-m", "hybridserve", *args], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _complete(base: str) -> list[int]:
    reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": PARAMS.max_tokens, "temperature": 0,
        "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def _node_resources() -> dict[str, dict]:
    return {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}


@pytest.mark.slow
def test_up_requests_restart_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a throwaway cluster of this test only: Ray's token auth off for its nodes, the CLI and this driver
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    model_dir, _ = nemotron_h("M*-M")
    expected = LLM(str(model_dir)).generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0].token_ids
    gcs_port, http_port, grpc_port = _free_port(), _free_port(), _free_port()
    address = f"127.0.0.1:{gcs_port}"
    procs: list[subprocess.Popen] = []
    # a temp dir of its own (short: it holds Unix sockets), so the cluster's address file does not make
    # later `ray.init()` calls of other tests join this cluster
    temp_dir = tempfile.mkdtemp(prefix="hsray-")
    try:
        procs.append(_start_node(["--head", "--temp-dir", temp_dir, "--port", str(gcs_port), "--num-cpus", "2",
                                  "--resources", "{}",
                                  "--include-dashboard", "false",
                                  "--ray-client-server-port", str(_free_port())], tmp_path / "head.log"))
        _wait_port(gcs_port, procs[0], STEP_TIMEOUT_S)
        ray.init(address=address, namespace="hybridserve", log_to_driver=False)
        for count, role in enumerate(("prefill", "decode"), start=2):  # one at a time: raylets start slowly
            procs.append(_start_node(["--address", address, "--num-cpus", "1", "--resources", json.dumps({role: 1})],
                                     tmp_path / f"{role}.log"))
            deadline = time.monotonic() + NODE_TIMEOUT_S
            while len(_node_resources()) < count:
                assert procs[-1].poll() is None, (tmp_path / f"{role}.log").read_text()[-2000:]
                assert time.monotonic() < deadline, f"nodes: {_node_resources()}"
                time.sleep(1)

        out = _cli("up", "--address", address, "--model", str(model_dir), "--prefill-workers", "1",
                   "--decode-workers", "1", "--port", str(http_port), "--grpc-port", str(grpc_port),
                   "--served-model-name", "tiny", "--timeout", str(STEP_TIMEOUT_S))
        found = re.search(r"OpenAI API\s+(http://\S+)/v1", out)
        assert found and f":{grpc_port}" in out, out
        base = found.group(1)
        assert _complete(base) == expected
        assert httpx.get(f"{base}/ready", timeout=10).status_code == 200
        assert {g["labels"]["component"] for g in httpx.get(f"{base}/targets", timeout=10).json()} >= {"router"}

        resources = _node_resources()
        for name, needed in (("hybridserve-prefill-0", "prefill"), ("hybridserve-decode-0", "decode"),
                             ("hybridserve-router", "node:__internal_head__")):
            node = ray.get(ray.get_actor(name).node_id.remote(), timeout=60)
            assert needed in resources[node], (name, resources[node])

        # idempotent: a second `up` with the same counts reuses the actors
        decode = ray.get_actor("hybridserve-decode-0")
        pid = ray.get(decode.pid.remote(), timeout=60)
        _cli("up", "--address", address, "--model", str(model_dir), "--port", str(http_port),
             "--grpc-port", str(grpc_port), "--served-model-name", "tiny", "--timeout", str(STEP_TIMEOUT_S))
        assert ray.get(decode.pid.remote(), timeout=60) == pid

        os.kill(pid, signal.SIGKILL)  # Ray restarts the actor (max_restarts); the router finds its new port
        deadline, last = time.monotonic() + STEP_TIMEOUT_S, None
        while time.monotonic() < deadline:
            try:
                if _complete(base) == expected:
                    break
            except (AssertionError, httpx.HTTPError) as exc:
                last = exc
            time.sleep(2)
        else:
            pytest.fail(f"no successful request after the decode worker was killed: {last}")
        assert ray.get(decode.pid.remote(), timeout=60) != pid

        # scaling down by re-running `up`: the prefill actor goes, the decode worker prefills itself
        _cli("up", "--address", address, "--model", str(model_dir), "--prefill-workers", "0", "--port",
             str(http_port), "--grpc-port", str(grpc_port), "--served-model-name", "tiny", "--timeout", str(STEP_TIMEOUT_S))
        assert "hybridserve-prefill-0" not in ray.util.list_named_actors()
        assert _complete(base) == expected

        out = _cli("down", "--address", address)
        assert "hybridserve-router" in out and "hybridserve-decode-0" in out, out
        assert not [n for n in ray.util.list_named_actors() if n.startswith("hybridserve-")]
    finally:
        ray.shutdown()
        _stop_nodes(procs)
        shutil.rmtree(temp_dir, ignore_errors=True)
