"""deploy/README.md's one-machine recipe, run as written (ports and Ray's temp dir moved out of the way): a head
with `--resources '{"prefill": 1, "decode": 1}'`, `up`, a request, `down`. On the same cluster, a deployment it
cannot place (two prefill workers) fails at once naming what is missing, for `up` and for `serve --address`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from serve_process import free_port

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 300
# the `ray` command of this interpreter: the cluster's workers then import this checkout's hybridserve
RAY = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"]


def _recipe() -> list[str]:
    text = (ROOT / "deploy" / "README.md").read_text()
    section = text.split("## One machine", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in section.replace("\\\n", " ").splitlines() if line.strip()]


def _cli(*args: str, timeout: float = STEP_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridserve", *args], capture_output=True, text=True, timeout=timeout)


def test_the_readme_names_the_recipe() -> None:
    recipe = _recipe()
    assert recipe[0] == """ray start --head --port 6379 --resources '{"prefill": 1, "decode": 1}'"""
    assert recipe[1].startswith("hybridserve up --address 127.0.0.1:6379")
    assert recipe[2].startswith("curl") and "/v1/completions" in recipe[2]
    assert recipe[3] == "hybridserve down --address 127.0.0.1:6379" and recipe[4] == "ray stop"


@pytest.mark.slow
def test_one_machine_recipe_and_unplaceable_deployments(tmp_path: Path) -> None:
    gcs = free_port()
    address = f"127.0.0.1:{gcs}"
    http_port, grpc_port = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="hsray-")  # short: it holds Unix sockets
    head = subprocess.Popen(
        [*RAY, "start", "--head", "--block", "--disable-usage-stats", "--port", str(gcs), "--resources",
         json.dumps({"prefill": 1, "decode": 1}), "--num-cpus", "2", "--include-dashboard", "false",
         "--temp-dir", temp_dir, "--ray-client-server-port", str(free_port())],
        stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115
    try:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while subprocess.run([*RAY, "status", "--address", address], capture_output=True).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-2000:]
            time.sleep(1)

        # what the node cannot hold fails before anything is placed, naming the resource
        for command in (["up", "--address", address], ["serve", "--address", address, "--port", "0", "--grpc-port", "0"]):
            start = time.monotonic()
            out = _cli(*command, "--prefill-workers", "2", "--timeout", "60")
            assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
            assert "the cluster offers prefill: 1, this needs 2" in out.stderr and "Traceback" not in out.stderr
            assert time.monotonic() - start < 60

        out = _cli("up", "--address", address, "--port", str(http_port), "--grpc-port", str(grpc_port),
                   "--timeout", str(STEP_TIMEOUT_S))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        base = re.search(r"OpenAI API\s+(http://\S+)/v1", out.stdout)
        assert base, out.stdout
        reply = httpx.post(f"{base.group(1)}/v1/completions", timeout=120,
                           json={"model": "demo_model", "prompt": "def fib(n):", "max_tokens": 16})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"], reply.text
        out = _cli("down", "--address", address)
        assert out.returncode == 0 and "hybridserve-router" in out.stdout, out.stdout + out.stderr
    finally:  # the head's own process group only (`ray stop` would stop every cluster of this user)
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)
                head.wait(timeout=wait_s)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        shutil.rmtree(temp_dir, ignore_errors=True)
