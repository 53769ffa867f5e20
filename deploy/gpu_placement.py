"""Which GPU each worker process of a deployment runs on, and the CUDA_VISIBLE_DEVICES it gets.

Default on a host with several GPUs: workers take GPUs round-robin in start order (prefill workers, then
decode workers), so 1 prefill + 1 decode worker on 2 GPUs run on GPU 0 and GPU 1. `--gpus` overrides:
  "prefill=0,decode=1"           every worker of a role on that GPU
  "prefill-0=0,decode-1=1"       one worker by id (ids are <role>-<index>)
  "0,1,1"                        one GPU per worker, in start order
A worker's own GPU comes first in its CUDA_VISIBLE_DEVICES (so it runs on cuda:0) and the host's other GPUs
after it, so same-host GPU->GPU state transfer (CUDA IPC) can reach its peers.

A tensor-parallel worker (tensor_parallel_size N: N processes, rank r on cuda:r) takes N contiguous GPUs, its
group first in its CUDA_VISIBLE_DEVICES (`assign_gpu_groups`); by default the groups do not share GPUs and
more GPUs than the host has is refused; under `--gpus` a worker's index is its group's first GPU.
"""

from __future__ import annotations

import logging
import subprocess

logger = logging.getLogger(__name__)


def assign_gpus(worker_ids: list[str], num_gpus: int, spec: str | None = None) -> dict[str, int]:
    """worker id -> GPU index; {} on a host without GPUs and no spec. Raises ValueError naming what to change."""
    if not spec:
        if num_gpus <= 0:
            return {}
        mapping = {wid: i % num_gpus for i, wid in enumerate(worker_ids)}
    else:
        mapping = _parse(spec, worker_ids)
    missing = {wid: gpu for wid, gpu in mapping.items() if not 0 <= gpu < num_gpus}
    if missing:
        raise ValueError(f"--gpus asks for GPU(s) {sorted(set(missing.values()))} but this host has {num_gpus} "
                         f"(valid: 0..{num_gpus - 1})" if num_gpus else "--gpus was given but this host has no GPU")
    shared = len(set(mapping.values())) < len(mapping)
    logger.info("GPU placement%s: %s", " (some workers share a GPU: split memory with --gpu-memory-gb)" if shared else "",
                ", ".join(f"{wid} -> GPU {gpu}" for wid, gpu in mapping.items()))
    return mapping


def assign_gpu_groups(worker_ids: list[str], num_gpus: int, sizes: dict[str, int],
                      spec: str | None = None) -> dict[str, list[int]]:
    """worker id -> its GPU indices (`sizes[wid]` contiguous ones, default 1); {} on a host without GPUs and
    no spec. All workers of size 1: `assign_gpus` (round-robin, sharing allowed). Raises ValueError naming
    what to change."""
    sizes = {wid: sizes.get(wid, 1) for wid in worker_ids}
    if all(size == 1 for size in sizes.values()):
        return {wid: [gpu] for wid, gpu in assign_gpus(worker_ids, num_gpus, spec).items()}
    if not spec:
        if num_gpus <= 0:
            return {}
        needed = sum(sizes.values())
        if needed > num_gpus:
            raise ValueError(f"the workers need {needed} GPUs ({', '.join(f'{w}: {n}' for w, n in sizes.items())}) "
                             f"but this host has {num_gpus}: lower --tensor-parallel-size or the worker counts, or "
                             "let workers share GPUs with --gpus (a tensor-parallel worker's index is its first GPU)")
        starts = [sum(list(sizes.values())[:i]) for i in range(len(worker_ids))]
        mapping = dict(zip(worker_ids, starts))
    else:
        if num_gpus <= 0:
            raise ValueError("--gpus was given but this host has no GPU")
        mapping = _parse(spec, worker_ids)
    groups = {wid: list(range(start, start + sizes[wid])) for wid, start in mapping.items()}
    for wid, group in groups.items():
        if group[0] < 0 or group[-1] >= num_gpus:
            raise ValueError(f"{wid} (tensor_parallel_size {sizes[wid]}) would run on GPUs {group[0]}..{group[-1]} "
                             f"but this host has {num_gpus} (valid: 0..{num_gpus - 1})")
    logger.info("GPU placement: %s", ", ".join(f"{wid} -> GPUs {g}" for wid, g in groups.items()))
    return groups


def _parse(spec: str, worker_ids: list[str]) -> dict[str, int]:
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise ValueError(f"--gpus {spec!r} names no GPU")
    if all("=" not in item for item in items):
        if len(items) != len(worker_ids):
            raise ValueError(f"--gpus lists {len(items)} GPUs for {len(worker_ids)} workers ({', '.join(worker_ids)})")
        return {wid: _index(item, spec) for wid, item in zip(worker_ids, items)}
    mapping: dict[str, int] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--gpus {spec!r}: mix no plain indices with name=gpu pairs")
        name, gpu = (part.strip() for part in item.split("=", 1))
        targets = [w for w in worker_ids if w == name or w.rsplit("-", 1)[0] == name]
        if not targets:
            raise ValueError(f"--gpus names {name!r}, which is no role or worker of this deployment ({', '.join(worker_ids)})")
        for target in targets:
            mapping[target] = _index(gpu, spec)
    unplaced = [w for w in worker_ids if w not in mapping]
    if unplaced:
        raise ValueError(f"--gpus {spec!r} leaves {', '.join(unplaced)} without a GPU")
    return mapping


def _index(text: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--gpus {spec!r}: {text!r} is not a GPU index") from None


def host_gpus(environ: dict[str, str]) -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES entries (its own setting, else every GPU
    nvidia-smi lists); [] without GPUs. No torch: the launcher stays light."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def visible_devices(gpu: int | list[int], gpus: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a worker on host GPU `gpu` (or a TP group's GPUs, rank r on the r-th): its
    own first, the others after (peers stay reachable for CUDA IPC)."""
    own = [gpu] if isinstance(gpu, int) else gpu
    return ",".join([*(gpus[g] for g in own), *(d for i, d in enumerate(gpus) if i not in own)])
