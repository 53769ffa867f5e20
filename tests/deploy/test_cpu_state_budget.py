"""On CPU the default state-cache budget follows the model and max_num_seqs (the running batch at max_model_len,
twice with prefix caching) instead of a fixed 2 GB, so a small model served with a small batch holds little."""

from __future__ import annotations

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.engine.cache_plan import plan_engine_cache
from hybridserve.engine.config import EngineConfig
from hybridserve.models.default_model import default_model_dir
from hybridserve.statepool.state_cache import CacheLayout


def _layout(**options) -> tuple[CacheLayout, ModelConfig, EngineConfig]:
    model = ModelConfig.from_dir(default_model_dir())
    config = EngineConfig(**options)
    return plan_engine_cache(model, config, 1024, 128, 0, torch.float32), model, config


def _bytes(layout: CacheLayout, model: ModelConfig, config: EngineConfig) -> int:
    slot = CacheLayout.bytes_per_slot(model, layout.conv_width, config.torch_dtype, torch.float32)
    return (layout.num_slots + layout.num_checkpoints) * slot + layout.num_pages * CacheLayout.bytes_per_page(
        model, layout.page_size, config.torch_dtype)


def test_default_cpu_budget_follows_the_batch() -> None:
    small, model, config = _layout(max_num_seqs=4)
    large, _, large_config = _layout(max_num_seqs=32)
    pages_per_seq = 1024 // small.page_size
    assert small.num_slots == 4 and small.num_pages >= 4 * pages_per_seq  # every running request at full length
    assert large.num_pages >= 32 * pages_per_seq
    assert _bytes(small, model, config) * 4 < _bytes(large, model, large_config)  # grows with the batch
    assert _bytes(large, model, large_config) < 1 << 30  # far below the old fixed 2 GB for the demo model


def test_an_explicit_cpu_budget_still_wins() -> None:
    fixed, model, config = _layout(max_num_seqs=4, cpu_memory_gb=0.5)
    default, _, _ = _layout(max_num_seqs=4)
    assert _bytes(fixed, model, config) > _bytes(default, model, config)
