"""Helpers for tests that run `hybridserve serve` as a user does: a subprocess, its banner, its children."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

READY_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def processes_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists() and
                 (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")]
    return alive


class ServeProcess:
    """`hybridserve serve --no-ray ...` in a subprocess, its output in a file; `base` once it serves."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        self.http_port = free_port()
        self._out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybridserve", "serve", "--no-ray", "--port", str(self.http_port),
             "--grpc-port", "0", "--log-dir", str(log.parent / "workers"), "--served-model-name", "tiny", *args],
            stdout=self._out, stderr=subprocess.STDOUT, text=True)
        self.base = f"http://127.0.0.1:{self.http_port}"

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str, timeout_s: float = READY_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output())
            if found:
                return found
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}:\n{self.output()[-3000:]}"
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in {timeout_s} s:\n{self.output()[-3000:]}")

    def wait_serving(self) -> None:
        self.wait_for(r"send requests to .*http://")

    def ready(self) -> httpx.Response:
        return httpx.get(f"{self.base}/ready", timeout=5)

    def complete(self) -> httpx.Response:
        return httpx.post(f"{self.base}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._out.close()
