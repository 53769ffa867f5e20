"""The Health fields both worker roles report besides load."""

from __future__ import annotations

from hybridserve.engine.llm_engine import LLMEngine


def health_fields(worker_id: str, engine: LLMEngine, metrics_port: int) -> dict:
    """What the router needs besides load: cache geometry (to hash prompts as the pool does), limits, metrics."""
    pages, slots = engine.pool.pages, engine.pool.slots
    return dict(
        worker_id=worker_id, block_size=engine.pool.block_size, state_block=engine.state_block,
        metrics_port=metrics_port, max_model_len=engine.max_model_len,
        total_state_slots=slots.capacity if slots is not None else 0,
        total_kv_pages=pages.capacity if pages is not None else 0,
    )
