"""How an engine's memory budget becomes its state-cache layout: the device budget (or `gpu_memory_gb`), less
the speculative decoder's working memory, split by `statepool.sizing` into slots, KV pages and checkpoints."""

from __future__ import annotations

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.spec_memory import spec_working_bytes
from hybridserve.statepool.sizing import PoolRequest, memory_budget_bytes, plan_cache_layout
from hybridserve.statepool.state_cache import CacheLayout


def plan_engine_cache(model_config: ModelConfig, config: EngineConfig, max_model_len: int, state_block: int,
                      lookahead: int, ssm_dtype: torch.dtype) -> CacheLayout:
    """The layout for `max_num_seqs` (+ `standby_state_slots`) requests of up to `max_model_len` (+ `lookahead`
    draft tokens)."""
    device = config.torch_device
    mamba = model_config.mamba
    conv_width = mamba.conv_kernel - 1 + lookahead if mamba else 1  # rollback slides the window back
    budget = memory_budget_bytes(device, config.cpu_memory_gb, config.gpu_memory_utilization)
    if device.type == "cuda" and config.gpu_memory_gb is not None:
        budget = int(config.gpu_memory_gb * (1 << 30))
    slots = config.max_num_seqs + (config.standby_state_slots or 0)
    # replay rollback keeps per-slot inputs (standby slots included); intermediate states are per running request
    spec_seqs = slots if config.speculative is not None and config.speculative.rollback == "replay" else config.max_num_seqs
    budget -= spec_working_bytes(model_config, config.speculative, spec_seqs, ssm_dtype, config.torch_dtype)
    return plan_cache_layout(
        model_config,
        budget,
        PoolRequest(
            max_num_seqs=config.max_num_seqs,
            standby_slots=config.standby_state_slots or 0,
            max_model_len=max_model_len + lookahead,
            page_size=config.page_size,
            conv_width=conv_width,
            dtype=config.torch_dtype,
            ssm_dtype=ssm_dtype,
            prefix_caching=config.enable_prefix_caching,
            state_block=state_block,
            num_kv_pages=config.num_kv_pages,
            num_checkpoint_slots=config.num_checkpoint_slots,
        ),
    )
