"""Starting a tensor-parallel group: rank 0 spawns its follower processes on this host (or joins a group a
launcher made), watches them (engine/tp_watch.py: exits and heartbeats) and loads its shard; a follower joins
the group, loads its shard and replays rank 0's commands (`tp_worker.follow`) until STOP."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridserve.common.model_config import ModelConfig
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.tp_watch import RankWatch, start_heartbeat
from hybridserve.engine.tp_worker import COLLECTIVE_TIMEOUT, Leader, follow
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.models.parallel import TPGroup
from hybridserve.models.tp_shard import dummy_shard, has_mtp_weights, load_shard, local_config

logger = logging.getLogger(__name__)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of one rank: its own GPU (cuda:rank of the group's CUDA_VISIBLE_DEVICES), or the CPU."""
    device = config.torch_device
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return device


def rank_model_config(model_dir: Path, config: EngineConfig) -> ModelConfig:
    """The checkpoint's config, with its MTP drafter only when the engine drafts with it and it ships weights
    (as `weights.load_model` decides at TP=1)."""
    model_config = config.runtime_model_config(ModelConfig.from_dir(model_dir))
    spec = config.speculative
    keep = spec is not None and spec.method == "mtp" and model_config.has_mtp and (
        config.load_format == "dummy" or has_mtp_weights(model_dir))
    return model_config if keep else dataclasses.replace(model_config, mtp_layer_types=())


def load_rank_model(model_dir: Path, config: EngineConfig, tp: TPGroup, device: torch.device) -> HybridLM:
    """This rank's shard of the checkpoint (or of the dummy weights)."""
    model_config = rank_model_config(model_dir, config)
    if config.load_format == "dummy":
        return dummy_shard(model_config, config.torch_dtype, device, tp, config.seed, config.kernels)
    return load_shard(model_dir, model_config, config.torch_dtype, device, tp, config.kernels)


def share_cores(device: torch.device, size: int) -> None:
    """CPU ranks split the host's cores: each rank's spinning OpenMP pool would starve the others (a TP=2 step
    on 2 cores took 30x longer with both ranks at full thread count)."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_leader(model_dir: Path, config: EngineConfig) -> tuple[Leader, HybridLM]:
    """Rank 0 of a TP group: joins torch.distributed's group when a launcher (torchrun) made one, else spawns
    ranks 1..N-1 on this host; returns the leader handle and rank 0's model."""
    size = config.tensor_parallel_size
    model_config = config.runtime_model_config(ModelConfig.from_dir(model_dir))
    for rank in range(size):  # shape errors before any process starts
        local_config(rank_model_config(model_dir, config), TPGroup(rank, size, None, config.enable_expert_parallel))
    backend = "nccl" if config.torch_device.type == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs (rank r on cuda:r) but this process sees "
                         f"{torch.cuda.device_count()}: set CUDA_VISIBLE_DEVICES to {size} GPUs or lower the size")
    processes: list[Any] = []
    watch: RankWatch | None = None
    owns_group = not dist.is_initialized()
    if owns_group:
        init = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        errors = context.SimpleQueue()  # a follower's last error, for the leader's message
        heartbeats = [context.Value("Q", 0, lock=False) for _ in range(1, size)]  # bumped by each follower
        log_level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, size):
            process = context.Process(target=follower_main, args=(rank, size, init, str(model_dir), config, errors,
                                                                  heartbeats[rank - 1], log_level),
                                      daemon=True, name=f"hybridserve-tp-{rank}")
            process.start()
            processes.append(process)
        watch = RankWatch(processes, errors, backend, heartbeats, config.tensor_parallel_hang_timeout_s)
        watch.rendezvous(lambda: dist.init_process_group(backend, init_method=init, rank=0, world_size=size,
                                                         timeout=COLLECTIVE_TIMEOUT))
    elif dist.get_world_size() != size or dist.get_rank() != 0:
        raise ValueError(f"torch.distributed has world size {dist.get_world_size()}, rank {dist.get_rank()}; "
                         f"a TP={size} engine runs on rank 0 of a group of {size}")
    tp = TPGroup(0, size, None, config.enable_expert_parallel)
    device = rank_device(config, 0)
    share_cores(device, size)
    leader = Leader(tp, device, processes, owns_group, dataclasses.replace(model_config, mtp_layer_types=()), watch)
    try:
        model = load_rank_model(model_dir, config, tp, device)
    except BaseException:
        leader.shutdown()
        raise
    logger.info("tensor-parallel engine: rank 0 of %d (%s)", size, backend)
    return leader, model


def exit_with_parent(poll_s: float = 1.0) -> None:
    """End this process when its parent (rank 0) is gone: a SIGKILLed worker or a killed Ray actor sends no
    STOP, and an NCCL follower would otherwise wait out the collective timeout holding its GPU."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.warning("tensor-parallel follower %d: rank 0 (pid %d) is gone, exiting", os.getpid(), parent)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()


def follower_main(rank: int, size: int, init: str | None, model_dir: str, config: EngineConfig,
                  errors: Any = None, heartbeat: Any = None, log_level: int = logging.WARNING) -> None:
    """A follower rank: join the group, load the shard, then replay rank 0's commands until STOP. `init`
    None: torch.distributed is set up by a launcher (torchrun's env://). An error that ends it goes to `errors`
    (rank 0's RankWatch names it) before it is raised; `heartbeat` (a shared counter) is bumped while the
    process runs, so rank 0 tells a stopped or wedged follower from a busy one; `log_level`: rank 0's."""
    logging.basicConfig(level=log_level)
    if heartbeat is not None:
        start_heartbeat(heartbeat)
    try:
        _follower(rank, size, init, model_dir, config, lambda: errors.put((rank, "")) if errors is not None else None)
    except BaseException as exc:
        if errors is not None:
            errors.put((rank, "".join(traceback.format_exception_only(type(exc), exc)).strip()))
        raise


def _follower(rank: int, size: int, init: str | None, model_dir: str, config: EngineConfig,
              joining: Callable[[], None]) -> None:
    if init is not None:  # spawned by rank 0
        exit_with_parent()
    device = rank_device(config, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    share_cores(device, size)
    if not dist.is_initialized():
        joining()  # rank 0 waits for this (watching this process) before its own, uninterruptible, rendezvous
        dist.init_process_group(backend, init_method=init or "env://", rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
    tp = TPGroup(rank, size, None, config.enable_expert_parallel)
    model = load_rank_model(Path(model_dir), config, tp, device)
    try:
        follow(model, tp, device, config, dataclasses.replace(ModelConfig.from_dir(model_dir), mtp_layer_types=()))
    finally:
        dist.destroy_process_group()
