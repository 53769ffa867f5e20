"""Start workers as plain processes (no Ray): what the GPU machine and the tests use.

Each worker is `python -m hybridserve worker --role ... --ready-file F`; it writes its gRPC address to F
once it serves, and the launcher waits for that file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from hybridserve.deploy.child_log import last_log_line
from hybridserve.deploy.options import WorkerOptions, configs_from_json
from hybridserve.deploy.parent_pipe import watch_parent_pipe
from hybridserve.deploy.process_heap import freeze_startup_heap

__all__ = ["PendingWorker", "WorkerOptions", "WorkerPorts", "WorkerProcess", "WorkerStartError", "configs_from_json",
           "serve_worker", "spawn_worker_process", "start_worker_process", "wait_ready", "watch_parent_pipe"]

READY_TIMEOUT_S = 300.0
INTERNAL_TOKEN_ENV = "HYBRIDSERVE_INTERNAL_TOKEN"  # the token reaches worker processes here, not in argv

logger = logging.getLogger(__name__)


class WorkerStartError(RuntimeError):
    """A worker process exited or did not become ready during start-up; the message is one line (the last
    line of its log and where the whole log is)."""


@dataclass(frozen=True)
class WorkerPorts:
    """The ports one worker binds: gRPC, its decode socket session, its Prometheus /metrics (0: a free one)."""

    grpc: int = 0
    session: int = 0
    metrics: int = 0

    @classmethod
    def from_base(cls, base: int, index: int) -> WorkerPorts:
        """Worker `index` (start order) of a deployment confined to ports from `base`: three consecutive ones."""
        if base == 0:
            return cls()
        first = base + 3 * index
        return cls(first, first + 1, first + 2)

    def argv(self) -> list[str]:
        return ["--port", str(self.grpc), "--session-port", str(self.session), "--metrics-port", str(self.metrics)]


@dataclass
class WorkerProcess:
    role: str
    worker_id: str
    process: subprocess.Popen
    address: str
    log_path: Path | None = None
    ports: WorkerPorts = field(default_factory=WorkerPorts)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the worker drains), SIGKILL after `timeout_s`; closes the pipe the worker watches."""
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process.stdin is not None:
            self.process.stdin.close()


@dataclass
class PendingWorker:
    """A spawned worker process that has not yet written its ready file."""

    role: str
    worker_id: str
    process: subprocess.Popen
    ready_file: Path
    log_path: Path
    ports: WorkerPorts

    def log_tail(self) -> str:
        return last_log_line(self.log_path)

    def cleanup(self) -> None:
        """Remove the ready file's temporary directory."""
        shutil.rmtree(self.ready_file.parent, ignore_errors=True)


def spawn_worker_process(role: str, worker_id: str, options: WorkerOptions, ports: WorkerPorts | None = None,
                         env: dict[str, str] | None = None, log_dir: Path | None = None,
                         verbose: bool | None = None) -> PendingWorker:
    """Start one `hybridserve worker` process without waiting for it. It runs in a session of its own (a
    Ctrl-C in the terminal reaches the launcher, which stops the workers in order) and watches its standard
    input, whose other end only the launcher holds: when the launcher exits in any way (SIGKILL included) the
    worker stops too, so no worker outlives the command that started it."""
    if verbose is None:
        verbose = logging.getLogger().isEnabledFor(logging.INFO)
    ports = ports or WorkerPorts()
    ready = Path(tempfile.mkdtemp(prefix="hybridserve-ready-")) / f"{worker_id}.json"
    log: IO[bytes]
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / f"{worker_id}.log", "wb")  # noqa: SIM115 - the worker process holds it
    else:
        log = tempfile.NamedTemporaryFile(prefix=f"hybridserve-{worker_id}-", suffix=".log", delete=False)
    argv = [sys.executable, "-m", "hybridserve", *(["--verbose"] if verbose else []), "worker", "--role", role,
            "--worker-id", worker_id, *ports.argv(), "--ready-file", str(ready), "--stop-on-stdin-close",
            *options.argv()]
    child_env = {**os.environ, **(env or {})}
    child_env.pop(INTERNAL_TOKEN_ENV, None)
    if options.internal_token:
        child_env[INTERNAL_TOKEN_ENV] = options.internal_token
    try:
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                   start_new_session=True)
    finally:
        log.close()  # the child holds its own descriptor
    return PendingWorker(role, worker_id, process, ready, Path(log.name), ports)


def wait_ready(pending: list[PendingWorker], timeout_s: float = READY_TIMEOUT_S) -> list[WorkerProcess]:
    """Wait until every pending worker serves; on the first that exits or on the deadline, stop them all and
    raise WorkerStartError saying which and why. Ready files are removed either way."""
    deadline = time.monotonic() + timeout_s
    ready: dict[str, WorkerProcess] = {}
    try:
        while len(ready) < len(pending):
            for p in pending:
                if p.worker_id in ready:
                    continue
                if p.ready_file.is_file():
                    address = json.loads(p.ready_file.read_text())["address"]
                    ready[p.worker_id] = WorkerProcess(p.role, p.worker_id, p.process, address, p.log_path, p.ports)
                    p.cleanup()
                elif p.process.poll() is not None:
                    raise WorkerStartError(f"{p.role} worker {p.worker_id} exited with {p.process.returncode} during "
                                           f"start-up: {p.log_tail() or 'no output'} (log: {p.log_path})")
            if len(ready) == len(pending):
                break
            if time.monotonic() > deadline:
                late = [p.worker_id for p in pending if p.worker_id not in ready]
                raise WorkerStartError(f"{', '.join(late)} did not become ready in {timeout_s:.0f} s (raise --timeout; "
                                       f"logs: {pending[0].log_path.parent})")
            time.sleep(0.1)
    except BaseException:  # an error, a deadline, Ctrl-C: nothing started here outlives this call
        for p in pending:
            stop_process(p.process)
            p.cleanup()
        raise
    return [ready[p.worker_id] for p in pending]


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; closes its stdin pipe (the worker's parent watch)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    if process.stdin is not None:
        try:
            process.stdin.close()
        except OSError:
            pass


def start_worker_process(role: str, worker_id: str, options: WorkerOptions, port: int = 0,
                         env: dict[str, str] | None = None, log_dir: Path | None = None,
                         verbose: bool | None = None, timeout_s: float = READY_TIMEOUT_S) -> WorkerProcess:
    """Spawn one worker (`env`: variables set for it, e.g. CUDA_VISIBLE_DEVICES) and wait until it serves;
    its output goes to `log_dir`/<worker_id>.log (a temporary file without one); raises WorkerStartError with
    its log's last line if it dies. `verbose` (INFO logs) defaults to whether this process logs INFO."""
    pending = spawn_worker_process(role, worker_id, options, WorkerPorts(grpc=port), env, log_dir, verbose)
    return wait_ready([pending], timeout_s)[0]


def serve_worker(role: str, worker_id: str, options: WorkerOptions, ports: WorkerPorts, ready_file: str | None) -> int:
    """Run one worker in this process until SIGTERM / SIGINT (the `hybridserve worker` command)."""
    from hybridserve.decode_worker.worker import DecodeWorker
    from hybridserve.prefill_worker.worker import PrefillWorker

    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    worker: PrefillWorker | DecodeWorker
    if role == "prefill":
        worker = PrefillWorker(options.model_dir, options.engine, host=options.host, port=ports.grpc,
                               worker_id=worker_id, metrics_port=ports.metrics, transfer=options.transfer,
                               internal_token=options.internal_token, internal_tls=options.internal_tls)
    else:
        worker = DecodeWorker(options.model_dir, options.engine, host=options.host, port=ports.grpc,
                              worker_id=worker_id, metrics_port=ports.metrics, transfer=options.transfer,
                              internal_token=options.internal_token, internal_tls=options.internal_tls,
                              session_port=ports.session)
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
    print(f"{role} worker {worker_id} stopped", flush=True)
    return 0
