"""How an engine's memory becomes its state-cache layout: the budget (the GPU's utilization share less what the
weights use and what a profiling forward measures for activations and CUDA graphs; `gpu_memory_gb` instead
when set; on CPU one that follows the model and max_num_seqs), less the speculative decoder's working memory,
planned by `statepool.sizing` into slots, KV pages and checkpoint rows."""

from __future__ import annotations

import logging

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.engine.batch_builder import PlacedRow, place_rows
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.spec_memory import spec_working_bytes
from hybridserve.models.hybrid_model import HybridLM
from hybridserve.statepool.sizing import (
    GIB,
    PoolRequest,
    cpu_budget_bytes,
    gpu_budget_bytes,
    plan_cache_layout,
    useful_bytes,
)
from hybridserve.statepool.state_cache import CacheLayout, StateCache

logger = logging.getLogger(__name__)


def profile_forward_bytes(model: HybridLM, model_config: ModelConfig, config: EngineConfig,
                          conv_width: int, ssm_dtype: torch.dtype, decode_rows: int) -> int:
    """Peak memory a step takes beyond the weights, measured (as vLLM's profiling run does): one prefill chunk
    of `prefill_chunk_tokens` through the model on a one-request scratch cache, then logits for `decode_rows`
    rows (the sampler's largest batch). With CUDA graphs their private pools keep about a decode step's
    activations, counted as the chunk's share of `decode_rows` tokens. Runs on CPU too (returns 0 there)."""
    device = config.torch_device
    tokens = config.prefill_chunk_tokens
    pages = -(-tokens // config.page_size)
    layout = CacheLayout(num_pages=pages, page_size=config.page_size, num_slots=1, conv_width=conv_width)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    scratch = StateCache(model_config, layout, config.torch_dtype, ssm_dtype, device)
    scratch_bytes = scratch.total_bytes()
    # token ids spread over the vocabulary: the values do not matter, only the shapes
    ids = [(i * 7919) % model_config.vocab_size for i in range(tokens)]
    batch, (input_ids,) = place_rows([PlacedRow(list(range(pages)), 0, tokens, 0)], 0, config.page_size, device,
                                     extra=[ids])
    with torch.inference_mode():
        hidden = model(input_ids, batch, scratch)  # [tokens, hidden]
        rows = min(decode_rows, tokens)
        logits = model.compute_logits(hidden[:rows])  # [rows, vocab]
        if decode_rows > rows:
            logits = model.compute_logits(hidden[:1].expand(decode_rows, -1).contiguous())
        del hidden, logits
    if not cuda:
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - scratch_bytes
    del scratch
    torch.cuda.empty_cache()
    graphs = peak * min(1.0, decode_rows / tokens) if config.cuda_graphs else 0
    return int(max(0, peak) + graphs)


def plan_engine_cache(model_config: ModelConfig, config: EngineConfig, max_model_len: int, state_block: int,
                      lookahead: int, ssm_dtype: torch.dtype, model: HybridLM | None = None) -> CacheLayout:
    """The layout for `max_num_seqs` (+ `standby_state_slots`) requests of up to `max_model_len` (+ `lookahead`
    draft tokens); `model` (loaded, not tensor-parallel) is profiled for the GPU budget's activation share."""
    device = config.torch_device
    mamba = model_config.mamba
    conv_width = mamba.conv_kernel - 1 + lookahead if mamba else 1  # rollback slides the window back
    standby = config.standby_state_slots or 0
    want = PoolRequest(
        max_num_seqs=config.max_num_seqs,
        standby_slots=standby,
        max_model_len=max_model_len + lookahead,
        page_size=config.page_size,
        conv_width=conv_width,
        dtype=config.torch_dtype,
        ssm_dtype=ssm_dtype,
        prefix_caching=config.enable_prefix_caching,
        state_block=state_block,
        num_kv_pages=config.num_kv_pages,
        num_checkpoint_slots=config.num_checkpoint_slots,
        plan_seq_len=config.plan_seq_len,
    )
    if device.type == "cuda" and config.gpu_memory_gb is not None:
        budget = int(config.gpu_memory_gb * GIB)
    elif device.type == "cuda":
        reserved = 0
        if model is not None:
            reserved = profile_forward_bytes(model, model_config, config, conv_width, ssm_dtype, config.max_num_seqs)
        budget = min(gpu_budget_bytes(device, config.gpu_memory_utilization, reserved), useful_bytes(model_config, want))
        logger.info("GPU memory: %.2f GiB for activations and graphs (profiled), %.2f GiB left for the state "
                    "cache at gpu_memory_utilization=%.2f", reserved / GIB, budget / GIB,
                    config.gpu_memory_utilization)
    else:
        budget = int(config.cpu_memory_gb * GIB) if config.cpu_memory_gb is not None else 0
    slots = config.max_num_seqs + standby
    # replay rollback keeps per-slot inputs (standby slots included); intermediate states are per running request
    spec_seqs = slots if config.speculative is not None and config.speculative.rollback == "replay" else config.max_num_seqs
    spec_bytes = spec_working_bytes(model_config, config.speculative, spec_seqs, ssm_dtype, config.torch_dtype)
    if device.type != "cuda" and config.cpu_memory_gb is None:  # the budget follows the model: spec on top
        budget = cpu_budget_bytes(model_config, want) + spec_bytes
    return plan_cache_layout(model_config, budget - spec_bytes, want)
