"""Size the state pools from a memory budget, and say what fits."""

from __future__ import annotations

import logging

import torch

from hybridserve.models.config import ModelConfig
from hybridserve.statepool.state_cache import CacheLayout

logger = logging.getLogger(__name__)


def memory_budget_bytes(device: torch.device, cpu_memory_gb: float, gpu_memory_utilization: float) -> int:
    """Bytes the state cache may take: a fixed budget on CPU; on GPU the utilization share minus what is used."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * gpu_memory_utilization) - used)
    return int(cpu_memory_gb * (1 << 30))


def plan_cache_layout(
    config: ModelConfig,
    budget_bytes: int,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
    dtype: torch.dtype,
    ssm_dtype: torch.dtype,
    conv_width: int,
) -> CacheLayout:
    """Slots for `max_num_seqs` requests and KV pages for as many tokens as the rest of the budget holds
    (never more than every slot filled to `max_model_len`)."""
    slot_bytes = CacheLayout.bytes_per_slot(config, conv_width, dtype, ssm_dtype)
    page_bytes = CacheLayout.bytes_per_page(config, page_size, dtype)
    pages_per_seq = -(-max_model_len // page_size) if page_bytes else 0
    one_request = slot_bytes + pages_per_seq * page_bytes
    if one_request > budget_bytes:
        raise ValueError(
            f"one request of max_model_len={max_model_len} needs {one_request / 2**20:.1f} MiB of state, "
            f"the state-cache budget is {budget_bytes / 2**20:.1f} MiB: raise cpu_memory_gb / "
            "gpu_memory_utilization or lower max_model_len"
        )
    slots = max_num_seqs
    if slots * slot_bytes + pages_per_seq * page_bytes > budget_bytes:
        slots = max(1, (budget_bytes - pages_per_seq * page_bytes) // max(slot_bytes, 1))
        logger.warning(
            "max_num_seqs lowered from %d to %d: %d Mamba state slots of %.1f MiB fit the budget",
            max_num_seqs, slots, slots, slot_bytes / 2**20,
        )
    num_pages = 0
    if page_bytes:
        num_pages = min((budget_bytes - slots * slot_bytes) // page_bytes, slots * pages_per_seq)
    layout = CacheLayout(num_pages=int(num_pages), page_size=page_size, num_slots=int(slots), conv_width=conv_width)
    full_len = (num_pages // pages_per_seq) if pages_per_seq else slots
    logger.info(
        "state cache: %d Mamba slots (%.2f MiB each), %d KV pages of %d tokens (%d tokens, %.2f MiB); "
        "%d concurrent requests fit, %d of them at max_model_len=%d",
        slots, slot_bytes / 2**20, num_pages, page_size, num_pages * page_size,
        num_pages * page_bytes / 2**20, slots, min(slots, full_len), max_model_len,
    )
    return layout
