"""Start workers as plain processes (no Ray): what the GPU machine and the tests use.

Each worker is `python -m hybridserve worker --role ... --ready-file F`; it writes its gRPC address to F
once it serves, and the launcher waits for that file.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hybridserve.deploy.options import WorkerOptions, configs_from_json
from hybridserve.deploy.process_heap import freeze_startup_heap

__all__ = ["WorkerOptions", "WorkerProcess", "configs_from_json", "serve_worker", "start_worker_process"]

READY_TIMEOUT_S = 300.0
INTERNAL_TOKEN_ENV = "HYBRIDSERVE_INTERNAL_TOKEN"  # the token reaches worker processes here, not in argv

logger = logging.getLogger(__name__)


@dataclass
class WorkerProcess:
    role: str
    worker_id: str
    process: subprocess.Popen
    address: str

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
            self.process.wait(timeout=30)


def start_worker_process(role: str, worker_id: str, options: WorkerOptions, port: int = 0,
                         env: dict[str, str] | None = None, log_dir: Path | None = None,
                         verbose: bool | None = None) -> WorkerProcess:
    """Spawn one worker (`env`: variables set for it, e.g. CUDA_VISIBLE_DEVICES) and wait until it serves;
    its output goes to `log_dir`/<worker_id>.log (a temporary file without one); raises RuntimeError with its
    log tail if it dies. `verbose` (INFO logs) defaults to whether this process logs INFO (`hybridserve -v`)."""
    if verbose is None:
        verbose = logging.getLogger().isEnabledFor(logging.INFO)
    ready = Path(tempfile.mkdtemp(prefix="hybridserve-ready-")) / f"{worker_id}.json"
    log: IO[bytes]
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / f"{worker_id}.log", "wb")  # noqa: SIM115 - the worker process holds it
    else:
        log = tempfile.NamedTemporaryFile(prefix=f"hybridserve-{worker_id}-", suffix=".log", delete=False)
    argv = [sys.executable, "-m", "hybridserve", *(["--verbose"] if verbose else []), "worker", "--role", role,
            "--worker-id", worker_id, "--port", str(port), "--ready-file", str(ready), *options.argv()]
    child_env = {**os.environ, **(env or {})}
    child_env.pop(INTERNAL_TOKEN_ENV, None)
    if options.internal_token:
        child_env[INTERNAL_TOKEN_ENV] = options.internal_token
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready.is_file():
            address = json.loads(ready.read_text())["address"]
            return WorkerProcess(role, worker_id, process, address)
        if process.poll() is not None:
            tail = Path(log.name).read_text()[-3000:]
            raise RuntimeError(f"{role} worker {worker_id} exited with {process.returncode}:\n{tail}")
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{role} worker {worker_id} did not become ready in {READY_TIMEOUT_S:.0f} s (log: {log.name})")


def serve_worker(role: str, worker_id: str, options: WorkerOptions, port: int, ready_file: str | None) -> int:
    """Run one worker in this process until SIGTERM / SIGINT (the `hybridserve worker` command)."""
    from hybridserve.decode_worker.worker import DecodeWorker
    from hybridserve.prefill_worker.worker import PrefillWorker

    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    cls = PrefillWorker if role == "prefill" else DecodeWorker
    worker = cls(options.model_dir, options.engine, host=options.host, port=port, worker_id=worker_id,
                 transfer=options.transfer, internal_token=options.internal_token,
                 internal_tls=options.internal_tls)
    address = worker.start()
    freeze_startup_heap(f"{role} worker {worker_id}")  # after the warm-up and graph capture, before ready
    if ready_file:
        tmp = Path(ready_file).with_suffix(".tmp")
        tmp.write_text(json.dumps({"address": address, "role": role, "worker_id": worker_id, "pid": os.getpid()}))
        tmp.rename(ready_file)
    leader = worker.engine.tp  # TP > 1: this process is rank 0 (gRPC + scheduler), the follower ranks its children
    group = (f" (tensor parallel: rank 0 of {leader.tp.size}, follower pids "
             f"{','.join(str(p.pid) for p in leader.processes)})") if leader is not None else ""
    print(f"{role} worker {worker_id} serving on {address}{group}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # set from a thread: Event.set() inside a handler deadlocks when the signal lands while this (main) thread
        # holds the Event's lock inside wait()
        signal.signal(sig, lambda *_: threading.Thread(target=done.set).start())
    while not done.wait(1.0):
        if worker.loop.stopped:  # a tensor-parallel rank died: this worker cannot serve; exit to be restarted
            print(f"{role} worker {worker_id}: engine loop stopped ({worker.loop.fatal}); exiting", flush=True)
            worker.stop()
            return 3
    aborted = worker.drain(options.drain_timeout_s)  # health says "draining": the router routes elsewhere
    print(f"{role} worker {worker_id} drained ({len(aborted)} requests aborted at the timeout)", flush=True)
    worker.stop()
    return 0
