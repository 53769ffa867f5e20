"""The Health fields both worker roles report besides load."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

from hybridserve.common.config_flags import to_jsonable
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.proto import common_pb2
from hybridserve.transfer.planes import TransferConfig


def health_fields(worker_id: str, engine: LLMEngine, metrics_port: int) -> dict:
    """What the router needs besides load: cache geometry (to hash prompts as the pool does), limits, metrics."""
    pages, slots = engine.pool.pages, engine.pool.slots
    return dict(
        worker_id=worker_id, block_size=engine.pool.block_size, state_block=engine.state_block,
        metrics_port=metrics_port, max_model_len=engine.max_model_len,
        total_state_slots=slots.capacity if slots is not None else 0,
        total_kv_pages=pages.capacity if pages is not None else 0,
        max_running=engine.max_running, max_num_waiting=engine.config.max_num_waiting,
    )


def health_response(
    role: str, worker_id: str, fingerprint: str, engine: LLMEngine, metrics_port: int, transfer: TransferConfig
) -> common_pb2.HealthResponse:
    """A worker's Health answer: load from the engine, `health_fields`, and the config it runs with (call on
    the engine loop)."""
    fields: dict[str, Any] = {**engine.stats(), **health_fields(worker_id, engine, metrics_port)}
    config = json.dumps({"engine": to_jsonable(engine.config), "transfer": to_jsonable(transfer)}, sort_keys=True)
    return common_pb2.HealthResponse(status="ok", role=role, model_fingerprint=fingerprint, config_json=config, **fields)


LOOP_ANSWER_S = 1.0  # how long Health waits for the engine loop (between two steps) before answering from its last
STALLED_STATUS = "stalled"  # Health.status of a worker whose engine has held one step for STALL_AFTER_S
# a single step this long is no progress: a hung kernel or collective, a deadlock; far above the longest
# legitimate step (a full-length prefill chunk on CPU under the Triton interpreter takes seconds, not a minute)
STALL_AFTER_S = 60.0


class HealthAnswer:
    """A worker's Health, answered within ~LOOP_ANSWER_S even mid-step: load is read on the engine loop between
    two steps; while a step runs longer, the last answer is repeated, with status "stalled" once the step has
    run STALL_AFTER_S. A live worker thus always answers, and the router tells a frozen one (no answer) from a
    busy one (an answer) and from a stuck engine ("stalled")."""

    def __init__(self, loop: Any, build: Any, stall_after_s: float = STALL_AFTER_S) -> None:
        self._loop = loop  # worker_runtime.engine_loop.EngineLoop
        self._build = build  # () -> HealthResponse, run on the loop
        self._stall_after_s = stall_after_s
        self._last: common_pb2.HealthResponse | None = None

    def __call__(self) -> common_pb2.HealthResponse:
        try:
            health = self._loop.call(self._build, timeout=LOOP_ANSWER_S if self._last is not None else 10.0)
            self._last = health
        except concurrent.futures.TimeoutError:
            if self._last is None:
                raise
            health = common_pb2.HealthResponse()
            health.CopyFrom(self._last)
        answer = common_pb2.HealthResponse()
        answer.CopyFrom(health)
        if self._loop.seconds_in_step() > self._stall_after_s:
            answer.status = STALLED_STATUS
        return answer
