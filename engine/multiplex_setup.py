"""How an engine gets its multiplexer (engine/multiplex.py): over green-context lanes of its GPU where SM partitions
can be made (`open_multiplexer`, at start-up with pd_multiplex), or over any partitioner (`attach`: a fake one in
CPU tests)."""

from __future__ import annotations

import logging

import torch

from hybridserve.engine.lane_scheduler import LaneScheduler
from hybridserve.engine.multiplex import MultiplexedEngine, Multiplexer
from hybridserve.engine.sm_partition import PartitionUnavailable, SmPartitioner, open_partitioner
from hybridserve.engine.sm_split import SplitController, SplitPolicy

logger = logging.getLogger(__name__)


def attach(engine: MultiplexedEngine, partitioner: SmPartitioner, policy: SplitPolicy | None = None) -> Multiplexer:
    """The multiplexer of `engine` (built with pd_multiplex: a LaneScheduler) over `partitioner`'s lanes (a fake
    partitioner in CPU tests); its step replaces the co-located one from now on."""
    scheduler = engine.scheduler
    if not isinstance(scheduler, LaneScheduler):
        raise ValueError("the engine was not built for pd_multiplex (its scheduler has no lanes): set pd_multiplex")
    controller = SplitController(policy or SplitPolicy(), partitioner.splits)
    multiplexer = Multiplexer(engine, scheduler, partitioner, controller)
    engine.multiplexer = multiplexer
    return multiplexer


def open_multiplexer(engine: MultiplexedEngine) -> Multiplexer | None:
    """With pd_multiplex, the multiplexer over green-context lanes of the engine's GPU; None without pd_multiplex or
    where SM partitions cannot be made (one WARNING: the engine runs co-located)."""
    config = engine.config
    if not config.pd_multiplex:
        return None
    device = config.torch_device
    total = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    try:
        partitioner = open_partitioner(device, config.multiplex_menu(total) if total else (1,))
    except PartitionUnavailable as exc:
        logger.warning("pd_multiplex: no SM partitions here (%s); prefill and decode run co-located, in the same "
                       "steps", exc)
        return None
    logger.info("pd_multiplex: prefill and decode lanes over %s", partitioner.describe())
    return attach(engine, partitioner, config.split_policy)
