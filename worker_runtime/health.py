"""The Health fields both worker roles report besides load."""

from __future__ import annotations

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
