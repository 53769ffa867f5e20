"""Checks run before `serve`, `up` or `worker` start anything: each failure is a `PreflightError`, one line that
names what to change, so a wrong flag costs a second instead of a model load, a traceback and orphaned workers.

What is checked: the checkpoint directory and its config.json, the ports the process will bind, GPUs when the
engine or the placement asks for them, the Ray address (something answers there) and the cluster's resources
(enough `prefill` / `decode` / GPU / CPU for the requested workers).
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path

GCS_DEFAULT_PORT = 6379  # `ray start --head` without --port


class PreflightError(ValueError):
    """A start-up condition that does not hold; the message is one line saying what to change."""


def check_model_dir(model_dir: str) -> None:
    """The checkpoint directory exists and holds a readable, parseable config.json (the words `generate` uses)."""
    path = Path(model_dir)
    if not path.exists():
        raise PreflightError(f"model directory {model_dir} does not exist: pass --model a checkpoint directory")
    if not path.is_dir():
        raise PreflightError(f"--model {model_dir} is a file: pass the checkpoint's directory")
    config = path / "config.json"
    if not config.is_file():
        raise PreflightError(f"{model_dir} is not a model directory: no config.json in it")
    try:
        data = json.loads(config.read_text())
    except OSError as exc:
        raise PreflightError(f"cannot read {config}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PreflightError(f"{config} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PreflightError(f"{config} must hold a JSON object")


def check_port_free(host: str, port: int, flag: str) -> None:
    """Nothing listens on `host:port` (port 0: the OS picks one later, nothing to check). Binds and closes a
    socket with SO_REUSEADDR, as the servers themselves do, so a port in TIME_WAIT does not count as taken."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PreflightError(f"port {port} on {host} is in use: stop what listens there or pass another "
                                     f"{flag} (0: a free one)") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise PreflightError(f"{host} is no address of this host: pass --host one of its addresses "
                                     "(127.0.0.1, 0.0.0.0)") from None
            if exc.errno == errno.EACCES:
                raise PreflightError(f"binding port {port} needs privileges: pass {flag} 1024 or above") from None
            raise PreflightError(f"cannot bind {host}:{port} ({exc.strerror}): pass another {flag}") from None


def check_ports_free(host: str, ports: Iterable[tuple[int, str]]) -> None:
    """`check_port_free` for each (port, flag) and no port named twice."""
    seen: dict[int, str] = {}
    for port, flag in ports:
        if port and port in seen:
            raise PreflightError(f"{seen[port]} and {flag} both name port {port}: give them different ports")
        seen[port] = flag
        check_port_free(host, port, flag)


def check_gpus(needed: int, available: int, what: str) -> None:
    """`needed` GPUs are asked for (`what` says by which flag) and `available` are visible."""
    if needed <= 0 or available >= needed:
        return
    if available == 0:
        raise PreflightError(f"{what} asks for GPUs but this host shows none (nvidia-smi / CUDA_VISIBLE_DEVICES): "
                             "pass --device cpu and --num-gpus-per-worker 0, or run on a GPU host")
    raise PreflightError(f"{what} needs {needed} GPUs, this host shows {available}: lower the worker counts or "
                         "--tensor-parallel-size")


def gcs_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a Ray address as `--address` spells it ("auto" and ray:// client addresses: None, Ray
    resolves those itself)."""
    if address == "auto" or "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, GCS_DEFAULT_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise PreflightError(f"--address {address!r} is not host:port (e.g. 10.0.0.1:6379) or auto") from None


def check_ray_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Something accepts TCP connections at the Ray address; otherwise Ray's own client retries "Failed to
    connect to GCS" for minutes."""
    endpoint = gcs_endpoint(address)
    if endpoint is None:
        return
    host, port = endpoint
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except socket.gaierror:
        raise PreflightError(f"--address {address}: {host} does not resolve; pass the head node's address") from None
    except OSError as exc:
        why = "refused the connection" if isinstance(exc, ConnectionRefusedError) else f"did not answer ({exc})"
        raise PreflightError(f"no Ray cluster at {address}: {host}:{port} {why}; start one with `ray start --head "
                             f"--port {port}` or pass --address the head's GCS address") from None


def check_cluster_resources(offered: Mapping[str, float], needed: Mapping[str, float]) -> None:
    """The cluster's resources cover what the workers ask for, e.g. "the cluster offers prefill: 1, this needs
    2" with how to offer more."""
    short = [(name, offered.get(name, 0.0), amount) for name, amount in needed.items()
             if amount > 0 and offered.get(name, 0.0) + 1e-9 < amount]
    if not short:
        return
    gaps = "; ".join(f"the cluster offers {name}: {_num(have)}, this needs {_num(want)}" for name, have, want in short)
    custom = [name for name, _, _ in short if name in ("prefill", "decode")]
    hint = (f"start nodes with `ray start --resources '{{\"{custom[0]}\": N}}'` or lower --{custom[0]}-workers"
            if custom else "add nodes (`ray status` shows what each offers) or lower the worker counts")
    raise PreflightError(f"{gaps}: {hint}")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
