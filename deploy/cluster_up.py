"""`hybridserve up` / `down`: a long-lived deployment on a running Ray cluster.

Everything is a named, detached Ray actor in one namespace, so the command that creates it can exit and a
later `up` finds the same actors (idempotent; changing the worker counts scales by creating or killing
actors `hybridserve-<role>-<i>`). The router runs on the head node as actor `hybridserve-router`; it re-reads
the workers' addresses from Ray by name, so a restarted worker (new port) is picked up without the driver.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from hybridserve.deploy.options import UpOptions
from hybridserve.deploy.process_heap import freeze_startup_heap
from hybridserve.proto.channels import is_loopback

__all__ = ["RouterActor", "UpOptions", "down", "up"]

logger = logging.getLogger(__name__)

NAMESPACE = "hybridserve"
ROUTER_NAME = "hybridserve-router"
WORKER_PREFIX = "hybridserve-"
HEAD_RESOURCE = "node:__internal_head__"  # Ray's built-in resource that only the head node offers
REFRESH_S = 2.0


class RouterActor:
    """The router (HTTP + gRPC front doors) inside a Ray actor; wrapped by `ray.remote` in `up`."""

    def __init__(self, options: UpOptions, prefill: list[str], decode: list[str]) -> None:
        import ray

        from hybridserve.router.app import Router

        self._counts = (options.num_prefill, options.num_decode)
        self._node_ip = ray.util.get_node_ip_address()
        self.router = Router(options.router, prefill, decode)
        freeze_startup_heap("router actor")  # before the doors open (a full collection must not meet a request)
        self.router.start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh_loop, name="worker-refresh", daemon=True)
        self._thread.start()

    def set_workers(self, num_prefill: int, num_decode: int) -> None:
        """The worker counts to route to (after `up` scaled them)."""
        self._counts = (num_prefill, num_decode)
        self._refresh()

    def _addresses(self) -> tuple[list[str], list[str]]:
        import ray

        from hybridserve.deploy.ray_workers import worker_name

        found: dict[str, list[str]] = {"prefill": [], "decode": []}
        for role, count in zip(("prefill", "decode"), self._counts):
            for i in range(count):
                try:
                    actor = ray.get_actor(worker_name(role, i), namespace=NAMESPACE)
                    found[role].append(ray.get(actor.address.remote(), timeout=5))
                except Exception as exc:  # not created yet, or restarting: route to the others meanwhile
                    logger.info("worker %s-%d not available: %s", role, i, exc)
        return found["prefill"], found["decode"]

    def _refresh(self) -> None:
        prefill, decode = self._addresses()
        if decode:  # none reachable (all restarting): keep the old list rather than route nowhere
            self.router.update_workers(prefill, decode)

    def _refresh_loop(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self._refresh()
            except Exception as exc:
                logger.warning("could not refresh worker addresses: %s", exc)

    def healthy(self) -> dict[str, int]:
        """Workers of each role that answer health checks and whose circuit breaker is closed."""
        prefill, decode = self.router.orchestrator.workers.snapshot()
        return {role: sum(1 for h in handles if h.health is not None and h.breaker.available())
                for role, handles in (("prefill", prefill), ("decode", decode))}

    def endpoints(self) -> list[str]:
        """The router's endpoint lines, with the head node's IP in place of a wildcard bind address."""
        return [line.replace("0.0.0.0", self._node_ip) for line in self.router.endpoints()]

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        self._stop.set()
        self.router.stop()


def _connect(address: str, timeout_s: float = 60.0) -> None:
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise ValueError("Ray is not installed: `pip install ray`") from exc
    from hybridserve.deploy.ray_workers import connect

    connect(address, timeout_s, NAMESPACE)


def _named_workers() -> list[str]:
    import ray

    return [n for n in ray.util.list_named_actors() if n.startswith(WORKER_PREFIX) and n != ROUTER_NAME]


def _role(name: str) -> str:
    return name[len(WORKER_PREFIX):].rsplit("-", 1)[0]


def _index(name: str) -> int:
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def _drain_and_remove(names: list[str], drain_timeout_s: float) -> None:
    """Scale-down without cutting streams: every actor named drains (its in-flight requests finish, up to
    `drain_timeout_s`) in parallel, then it is killed; one that cannot drain (dead, restarting) is killed."""
    import ray

    from hybridserve.deploy.ray_workers import release_group

    actors = {name: ray.get_actor(name) for name in names}
    pending = {name: actor.drain.remote(drain_timeout_s) for name, actor in actors.items()}
    for name, ref in pending.items():
        try:
            aborted = ray.get(ref, timeout=drain_timeout_s + 60)
            logger.info("%s drained (%d requests aborted at the drain timeout)", name, aborted)
        except Exception as exc:
            logger.warning("%s did not drain (%s): killing it", name, exc)
        ray.kill(actors[name], no_restart=True)
        release_group(name)  # a TP worker's GPUs


def up(options: UpOptions) -> list[str]:
    """Create or scale the deployment, wait until every worker is healthy; returns the endpoint lines."""
    import ray

    from hybridserve.deploy.ray_workers import RayPlacement, actor_addresses, check_cluster, start_ray_workers

    deadline = time.monotonic() + options.timeout_s
    _connect(options.address, options.timeout_s)
    check_cluster(options, options.num_gpus_per_worker)
    if not options.worker.internal_tls.enabled and not is_loopback(options.worker.host):
        insecure = "no internal token, " if options.worker.internal_token is None else ""
        logger.warning("workers bind %s with %splaintext internal gRPC: pass --internal-tls-ca-file/-cert-file/"
                       "-key-file beyond a trusted network", options.worker.host, insecure)
    placement = RayPlacement(num_gpus=options.num_gpus_per_worker, max_restarts=options.max_restarts,
                             namespace=NAMESPACE, detached=True, ready_timeout_s=options.timeout_s)
    actors = start_ray_workers(options, placement)
    prefill = actor_addresses(actors["prefill"], timeout=max(1.0, deadline - time.monotonic()))
    decode = actor_addresses(actors["decode"], timeout=max(1.0, deadline - time.monotonic()))
    keep = {"prefill": options.num_prefill, "decode": options.num_decode}
    router: Any = ray.remote(RouterActor).options(  # an actor handle: Ray's stubs type its methods as plain functions
        name=ROUTER_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        resources={HEAD_RESOURCE: 0.001}, max_restarts=options.max_restarts,
    ).remote(options, prefill, decode)
    # the router routes to the new counts first; then the workers beyond them drain and go
    ray.get(router.set_workers.remote(options.num_prefill, options.num_decode), timeout=options.timeout_s)
    _drain_and_remove([name for name in _named_workers() if _index(name) >= keep.get(_role(name), _index(name) + 1)],
                      options.worker.drain_timeout_s)
    healthy: dict[str, int] = {}
    while time.monotonic() < deadline:
        healthy = ray.get(router.healthy.remote(), timeout=max(1.0, deadline - time.monotonic()))
        if healthy == keep:
            return ray.get(router.endpoints.remote(), timeout=60)
        time.sleep(1.0)
    raise TimeoutError(f"after {options.timeout_s:.0f}s {healthy} workers are healthy, want {keep}: "
                       "check `ray status` for the `prefill` / `decode` resources and the actors' logs")


def down(address: str, timeout_s: float = 60.0) -> list[str]:
    """Stop the router and kill every hybridserve actor; returns the names removed."""
    import ray

    _connect(address)
    removed = []
    if ROUTER_NAME in ray.util.list_named_actors():
        router = ray.get_actor(ROUTER_NAME)
        try:
            ray.get(router.stop.remote(), timeout=timeout_s)
        except Exception as exc:  # kill it anyway
            logger.warning("router did not stop cleanly: %s", exc)
        ray.kill(router, no_restart=True)
        removed.append(ROUTER_NAME)
    from hybridserve.deploy.ray_workers import release_group

    for name in _named_workers():
        ray.kill(ray.get_actor(name), no_restart=True)
        release_group(name)
        removed.append(name)
    return removed
