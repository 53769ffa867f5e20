"""Ray actors around the workers: placement by custom resources (`prefill` / `decode`), restarts, discovery.

An actor's constructor starts the worker's gRPC server; after a restart (`max_restarts`) the new instance
serves on a new port, so callers re-read `address()`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from hybridserve.deploy.options import NODE_IP, ClusterOptions, WorkerOptions

logger = logging.getLogger(__name__)


class WorkerActor:
    """Wrapped by `ray.remote` in `start_ray_workers`; kept a plain class so it is importable without Ray."""

    def __init__(self, role: str, options: WorkerOptions, worker_id: str) -> None:
        import ray

        from hybridserve.decode_worker.worker import DecodeWorker
        from hybridserve.prefill_worker.worker import PrefillWorker

        cls = PrefillWorker if role == "prefill" else DecodeWorker
        node_ip = ray.util.get_node_ip_address()
        host = node_ip if options.host == NODE_IP else options.host  # the address it is told, 0.0.0.0 only if asked
        self.worker = cls(options.model_dir, options.engine, host=host, port=0, worker_id=worker_id,
                          transfer=options.transfer, internal_token=options.internal_token)
        bound = self.worker.start().rsplit(":", 1)[1]
        self._address = f"{node_ip if host in ('0.0.0.0', '::') else host}:{bound}"  # where others reach it
        self.role = role

    def address(self) -> str:
        return self._address

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


@dataclass(frozen=True)
class RayPlacement:
    """How actors are placed: GPUs each, the custom resource they need, restarts allowed."""

    num_gpus: float = 0.0
    use_custom_resources: bool = True  # require {"prefill": 1} / {"decode": 1} on the node
    max_restarts: int = 3
    namespace: str = "hybridserve"
    detached: bool = False  # `hybridserve up`: actors outlive the driver that created them


def start_ray_workers(options: ClusterOptions, placement: RayPlacement) -> dict[str, list]:
    """Named actors `hybridserve-<role>-<i>` (an existing one is reused); returns {"prefill": [...], "decode": [...]}."""
    import ray

    remote_cls = ray.remote(WorkerActor)
    actors: dict[str, list] = {"prefill": [], "decode": []}
    for role, count in (("prefill", options.num_prefill), ("decode", options.num_decode)):
        for i in range(count):
            name = worker_name(role, i)
            actor_options: dict[str, object] = dict(
                name=name, num_gpus=placement.num_gpus, num_cpus=1, max_restarts=placement.max_restarts,
                max_task_retries=0, get_if_exists=True,
            )
            if placement.use_custom_resources:
                actor_options["resources"] = {role: 1}
            if placement.detached:
                actor_options.update(lifetime="detached", namespace=placement.namespace)
            actors[role].append(remote_cls.options(**actor_options).remote(role, options.worker_for(role), name))
    return actors


def worker_name(role: str, index: int) -> str:
    """The Ray actor name of worker `index` of `role`."""
    return f"hybridserve-{role}-{index}"


def actor_addresses(actors: list, timeout: float = 300.0) -> list[str]:
    """gRPC addresses of running worker actors (waits for constructors / restarts up to `timeout`)."""
    import ray

    return ray.get([a.address.remote() for a in actors], timeout=timeout)
