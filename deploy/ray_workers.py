"""Ray actors around the workers: placement by custom resources (`prefill` / `decode`), restarts, discovery.

An actor's constructor starts the worker's gRPC server; after a restart (`max_restarts`) the new instance
serves on a new port, so callers re-read `address()`.

A tensor-parallel worker on GPUs (tensor_parallel_size N > 1) reserves a placement group of N one-GPU bundles
packed on one node (STRICT_PACK); the actor (rank 0) runs in bundle 0 and is told the GPU ids of all N bundles,
which become its CUDA_VISIBLE_DEVICES before CUDA starts, so its follower ranks (child processes) use the GPUs
reserved for them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from hybridserve.deploy.options import NODE_IP, ClusterOptions, WorkerOptions
from hybridserve.deploy.process_heap import freeze_startup_heap

logger = logging.getLogger(__name__)


class WorkerActor:
    """Wrapped by `ray.remote` in `start_ray_workers`; kept a plain class so it is importable without Ray."""

    def __init__(self, role: str, options: WorkerOptions, worker_id: str, group_gpus: list[str] | None = None,
                 ports: tuple[int, int, int] = (0, 0, 0)) -> None:
        import ray

        if group_gpus:  # a TP group's GPUs (its placement group's bundles), rank r on cuda:r; CUDA is not up yet
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(group_gpus)

        from hybridserve.decode_worker.worker import DecodeWorker
        from hybridserve.prefill_worker.worker import PrefillWorker

        node_ip = ray.util.get_node_ip_address()
        host = node_ip if options.host == NODE_IP else options.host  # the address it is told, 0.0.0.0 only if asked
        grpc_port, session_port, metrics_port = ports  # --worker-port-base (0: free ports)
        self.worker: PrefillWorker | DecodeWorker
        if role == "prefill":
            self.worker = PrefillWorker(options.model_dir, options.engine, host=host, port=grpc_port,
                                        worker_id=worker_id, metrics_port=metrics_port, transfer=options.transfer,
                                        internal_token=options.internal_token, internal_tls=options.internal_tls)
        else:
            self.worker = DecodeWorker(options.model_dir, options.engine, host=host, port=grpc_port,
                                       worker_id=worker_id, metrics_port=metrics_port, transfer=options.transfer,
                                       internal_token=options.internal_token, internal_tls=options.internal_tls,
                                       session_port=session_port)
        bound = self.worker.start().rsplit(":", 1)[1]
        freeze_startup_heap(f"{role} worker {worker_id}")  # an actor's process serves from here to its end
        self._address = f"{node_ip if host in ('0.0.0.0', '::') else host}:{bound}"  # where others reach it
        self.role = role

    def address(self) -> str:
        return self._address

    def drain(self, timeout_s: float) -> int:
        """Scale-down: health says "draining" (the router routes elsewhere), new requests are refused, the ones
        in flight get `timeout_s` to finish (then they are aborted with an error their clients see), then the
        server stops. Returns how many were aborted; the caller kills the actor after."""
        aborted = self.worker.drain(timeout_s)
        self.worker.stop()
        return len(aborted)

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
    ready_timeout_s: float = 600.0  # how long a TP group's placement group may wait for its GPUs


def group_bundles(size: int, role: str | None) -> list[dict[str, float]]:
    """The placement-group bundles of a TP group: one GPU (and one CPU) per rank; bundle 0 (rank 0, the actor)
    also takes the node's `role` custom resource when placement asks for it."""
    bundles: list[dict[str, float]] = [{"GPU": 1.0, "CPU": 1.0} for _ in range(size)]
    if role is not None:
        bundles[0][role] = 1.0
    return bundles


def _reserve_group(name: str, size: int, role: str | None, placement: RayPlacement) -> tuple[Any, list[str]]:
    """A ready STRICT_PACK placement group for a TP group and the node GPU ids of its bundles, in rank order."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group(group_bundles(size, role), strategy="STRICT_PACK", name=f"{name}-gpus",
                            lifetime="detached" if placement.detached else None)
    ray.get(group.ready(), timeout=placement.ready_timeout_s)

    def gpu_ids() -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    probe = ray.remote(gpu_ids)
    ids = ray.get([probe.options(num_gpus=1, num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=rank)).remote() for rank in range(size)])
    return group, [gpu for bundle in ids for gpu in bundle]


def start_ray_workers(options: ClusterOptions, placement: RayPlacement) -> dict[str, list]:
    """Named actors `hybridserve-<role>-<i>` (an existing one is reused); returns {"prefill": [...], "decode": [...]}."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote_cls = ray.remote(WorkerActor)
    actors: dict[str, list] = {"prefill": [], "decode": []}
    for role, count in (("prefill", options.num_prefill), ("decode", options.num_decode)):
        worker = options.worker_for(role)
        size = worker.engine.tensor_parallel_size
        for i in range(count):
            base = options.worker_port_base
            first = base + 3 * (i if role == "prefill" else options.num_prefill + i) if base else 0
            ports = (first, first + 1, first + 2) if base else (0, 0, 0)
            name = worker_name(role, i)
            actor_options: dict[str, object] = dict(
                name=name, num_gpus=placement.num_gpus, num_cpus=1, max_restarts=placement.max_restarts,
                max_task_retries=0, get_if_exists=True,
            )
            if placement.use_custom_resources:
                actor_options["resources"] = {role: 1}
            if placement.detached:
                actor_options.update(lifetime="detached", namespace=placement.namespace)
            group_gpus = None
            # a TP group: N GPUs on one node, the actor in bundle 0 (a running actor keeps its reservation)
            if size > 1 and placement.num_gpus > 0 and not _exists(name, placement.namespace):
                group, group_gpus = _reserve_group(name, size, role if placement.use_custom_resources else None,
                                                   placement)
                actor_options.update(num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=0))
            actors[role].append(remote_cls.options(**actor_options).remote(role, worker, name, group_gpus, ports))
    return actors


def _exists(name: str, namespace: str) -> bool:
    """Whether the named actor runs (then `get_if_exists` reuses it, and its GPUs stay reserved)."""
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def release_group(name: str) -> None:
    """Free the placement group of worker actor `name` (a TP group's GPUs), if it has one."""
    from ray.util import get_placement_group, remove_placement_group

    try:
        remove_placement_group(get_placement_group(f"{name}-gpus"))
    except ValueError:  # no such group: a TP=1 or CPU worker
        pass


def worker_name(role: str, index: int) -> str:
    """The Ray actor name of worker `index` of `role`."""
    return f"hybridserve-{role}-{index}"


def actor_addresses(actors: list, timeout: float = 300.0) -> list[str]:
    """gRPC addresses of running worker actors (waits for constructors / restarts up to `timeout`; past it,
    TimeoutError naming the actors still pending and what the cluster has free)."""
    import ray
    from ray.exceptions import GetTimeoutError

    refs = [a.address.remote() for a in actors]
    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        late = [i for i, ref in enumerate(refs) if ref not in done]
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU", "prefill", "decode")}
        raise TimeoutError(f"{len(late)} of {len(refs)} worker actors did not start in {timeout:.0f} s; the cluster "
                           f"has free {_resources(free)}: check `ray status` and the actors' logs, or raise "
                           "--timeout") from None


def resources_needed(options: ClusterOptions, num_gpus: float) -> dict[str, float]:
    """What the deployment's worker actors ask the cluster for in all: one `prefill` / `decode` and one CPU
    each, `num_gpus` GPUs each (a tensor-parallel worker on GPUs: one GPU and one CPU per rank)."""
    needed = {"prefill": float(options.num_prefill), "decode": float(options.num_decode), "CPU": 0.0, "GPU": 0.0}
    for role, count in (("prefill", options.num_prefill), ("decode", options.num_decode)):
        size = options.worker_for(role).engine.tensor_parallel_size
        per = (float(size), float(size)) if size > 1 and num_gpus > 0 else (1.0, num_gpus)
        needed["CPU"] += count * per[0]
        needed["GPU"] += count * per[1]
    return needed


def _resources(values: dict[str, float]) -> str:
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(values.items())) or "nothing"


def connect(address: str, timeout_s: float, namespace: str) -> None:
    """ray.init, bounded: joins `address` (checked to answer first; a bare `serve` starts a head of its own
    first, deploy/ray_head.py); TimeoutError when Ray has not connected within `timeout_s` (its client otherwise
    retries "Failed to connect to GCS" for minutes)."""
    import threading

    import ray

    from hybridserve.deploy.preflight import check_ray_reachable

    if ray.is_initialized():
        return
    check_ray_reachable(address, timeout_s=min(5.0, timeout_s))
    failure: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=init, name="ray-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"could not connect to the Ray cluster at {address} in {timeout_s:.0f} s: check that its GCS answers "
                           "(`ray status --address ...`), or raise --timeout")
    if failure:
        exc = failure[0]
        if isinstance(exc, ConnectionError | ValueError | RuntimeError):
            raise ValueError(f"cannot join Ray at {address}: {exc}") from None
        raise exc


def check_cluster(options: ClusterOptions, num_gpus: float) -> None:
    """The connected cluster has the resources the workers need (in all, not just free: `up` re-runs reuse the
    actors that already hold theirs); PreflightError naming what is short."""
    import ray

    from hybridserve.deploy.preflight import check_cluster_resources

    check_cluster_resources(ray.cluster_resources(), resources_needed(options, num_gpus))
