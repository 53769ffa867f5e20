"""CUDA graphs of a multiplexed engine (engine/multiplex.py): decode graphs captured in each split's decode lane and
prefill graphs in its prefill lane, so a replay runs on the SMs of the partition it was captured for.

The decode graphs of every split share one memory pool and the prefill graphs another: graphs of one lane never
replay at the same time (one decode step, one prefill forward at a time) and each replay's outputs are read before
that lane's next one, while a decode and a prefill graph do run at the same time and must not alias each other's
intermediates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from hybridserve.engine.cuda_graphs import DecodeGraphs
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.prefill_graphs import PrefillGraphs
from hybridserve.engine.sm_partition import SmPartitioner, SmSplit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaneGraphs:
    """One split's graphs: decode (or verify) graphs of its decode lane, prefill graphs of its prefill lane."""

    decode: DecodeGraphs | None
    prefill: PrefillGraphs | None


def capture_lane_graphs(runner: ModelRunner, partitioner: SmPartitioner, max_batch: int, max_pages: int,
                        prefill_tokens: int, prefill: bool) -> dict[SmSplit, LaneGraphs]:
    """Graphs for every split of the partitioner's menu (the runner's model, cache and speculative shape); a split
    whose capture fails keeps none (its steps run eagerly), as the co-located engine does."""
    spec = runner.spec
    decode_pool: Any = None
    prefill_pool: Any = None
    captured: dict[SmSplit, LaneGraphs] = {}
    for split in partitioner.splits:
        prefill_lane, decode_lane = partitioner.lanes(split)
        decode = DecodeGraphs(runner.model, runner.cache, max_batch, max_pages,
                              tokens=spec.tokens if spec is not None else 1,
                              rollback=spec.config.rollback if spec is not None else None)
        decode.pool = decode_pool
        decode = _captured(decode, decode_lane.stream, f"decode graphs of split {split}")
        if decode is not None:
            decode_pool = decode.pool
        graphs = None
        if prefill and decode is not None and runner.state_block is not None:
            mamba = runner.model.config.mamba
            graphs = PrefillGraphs(runner.model, runner.cache, max_pages,
                                   mamba.chunk_size if mamba else runner.state_block, runner.state_block, prefill_tokens)
            graphs.pool = prefill_pool
            graphs = _captured(graphs, prefill_lane.stream, f"prefill graphs of split {split}")
            if graphs is not None:
                prefill_pool = graphs.pool
        captured[split] = LaneGraphs(decode, graphs)
    logger.info("pd_multiplex: captured CUDA graphs in the lanes of %d splits", len(captured))
    return captured


def _captured(graphs: Any, stream: torch.cuda.Stream | None, what: str) -> Any:
    """`graphs` captured on `stream`, or None when the capture failed (logged)."""
    try:
        graphs.capture(stream)
    except Exception as exc:  # noqa: BLE001 - a failed capture leaves the eager path, which works
        logger.warning("pd_multiplex: %s not capturable, running eagerly: %s", what, exc)
        torch.cuda.synchronize()
        return None
    return graphs
