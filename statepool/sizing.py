"""Size the state pools from a memory budget, and say what fits."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.statepool.state_cache import CacheLayout

logger = logging.getLogger(__name__)


def memory_budget_bytes(device: torch.device, cpu_memory_gb: float, gpu_memory_utilization: float) -> int:
    """Bytes the state cache may take: a fixed budget on CPU; on GPU the utilization share minus what is used."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(0, int(total * gpu_memory_utilization) - used)
    return int(cpu_memory_gb * (1 << 30))


@dataclass(frozen=True)
class PoolRequest:
    """What the engine asks of the pools; the overrides skip budget-based sizing of that pool."""

    max_num_seqs: int
    max_model_len: int
    page_size: int
    conv_width: int
    dtype: torch.dtype
    ssm_dtype: torch.dtype
    prefix_caching: bool = False
    state_block: int = 1  # tokens between cached Mamba checkpoints
    num_kv_pages: int | None = None
    num_checkpoint_slots: int | None = None
    standby_slots: int = 0  # state slots beyond max_num_seqs (requests outside the running batch)

    def __post_init__(self) -> None:
        if self.standby_slots < 0:
            raise ValueError(f"standby_slots must be >= 0, got {self.standby_slots}")
        for name in ("max_num_seqs", "max_model_len", "page_size", "conv_width", "state_block"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_pages is not None and self.num_kv_pages <= 0:
            raise ValueError(f"num_kv_pages must be positive, got {self.num_kv_pages}")
        if self.num_checkpoint_slots is not None and self.num_checkpoint_slots < 0:
            raise ValueError(f"num_checkpoint_slots must be >= 0, got {self.num_checkpoint_slots}")


def plan_cache_layout(config: ModelConfig, budget_bytes: int, want: PoolRequest) -> CacheLayout:
    """Slots for `max_num_seqs` (+ `standby_slots`) requests first; the rest goes to KV pages and, with prefix
    caching, checkpoint slots. Without caching, pages stop at every slot filled to max_model_len. With it,
    the page target doubles (running + cached KV) and checkpoints cover the cached tokens every state_block;
    when the budget is short both shrink proportionally, but the running KV (the no-cache amount) is kept
    once the cache has one checkpoint per running slot, and never below one max_model_len request of KV."""
    slot_bytes = CacheLayout.bytes_per_slot(config, want.conv_width, want.dtype, want.ssm_dtype)
    page_bytes = CacheLayout.bytes_per_page(config, want.page_size, want.dtype)
    pages_per_seq = -(-want.max_model_len // want.page_size) if page_bytes else 0
    min_pages = pages_per_seq if want.num_kv_pages is None else want.num_kv_pages
    if not page_bytes:
        min_pages = 0
    one_request = slot_bytes + min_pages * page_bytes
    if one_request > budget_bytes:
        raise ValueError(
            f"one request of max_model_len={want.max_model_len} needs {one_request / 2**20:.1f} MiB of state, "
            f"the state-cache budget is {budget_bytes / 2**20:.1f} MiB: raise cpu_memory_gb / "
            "gpu_memory_utilization or lower max_model_len"
        )
    slots = want.max_num_seqs + want.standby_slots
    if slots * slot_bytes + min_pages * page_bytes > budget_bytes:
        slots = max(1, (budget_bytes - min_pages * page_bytes) // max(slot_bytes, 1))
        logger.warning(
            "max_num_seqs lowered from %d to %d: %d Mamba state slots of %.1f MiB fit the budget",
            want.max_num_seqs + want.standby_slots, slots, slots, slot_bytes / 2**20,
        )
    # the running batch's slots earn a kept checkpoint before cached KV; standby slots (states waiting outside
    # the batch) do not, or a big standby pool would leave no KV for the requests it holds
    seats = min(slots, want.max_num_seqs)
    rest = budget_bytes - slots * slot_bytes
    copies = 2 if want.prefix_caching else 1
    page_target = copies * slots * pages_per_seq if want.num_kv_pages is None else want.num_kv_pages
    page_target = page_target if page_bytes else 0
    ckpt_target = 0
    if want.prefix_caching and slot_bytes:
        cached_tokens = page_target * want.page_size if page_bytes else copies * slots * want.max_model_len
        ckpt_target = max(seats, cached_tokens // want.state_block)
        if want.num_checkpoint_slots is not None:
            ckpt_target = want.num_checkpoint_slots
    pages, ckpts = page_target, ckpt_target
    if pages * page_bytes + ckpts * slot_bytes > rest:
        flexible_pages = want.num_kv_pages is None
        flexible_ckpts = want.num_checkpoint_slots is None
        fixed = (0 if flexible_pages else pages * page_bytes) + (0 if flexible_ckpts else ckpts * slot_bytes)
        scale = max(0.0, rest - fixed) / max(1, (pages * page_bytes if flexible_pages else 0)
                                              + (ckpts * slot_bytes if flexible_ckpts else 0))
        if flexible_pages and page_bytes:
            # KV for the running requests (what the pool would get without the cache) comes before cached
            # state, once the cache keeps one checkpoint per running slot
            keep_ckpts = min(ckpt_target, seats) if flexible_ckpts else ckpts
            running = min(slots * pages_per_seq, max(0, rest - keep_ckpts * slot_bytes) // page_bytes)
            pages = max(min_pages, running, int(pages * scale))
        if flexible_ckpts:
            ckpts = max(0, (rest - pages * page_bytes) // max(slot_bytes, 1)) if slot_bytes else 0
            ckpts = min(ckpts, ckpt_target)
        if flexible_pages and page_bytes:  # what the checkpoints could not use goes back to KV
            pages = min(page_target, max(pages, (rest - ckpts * slot_bytes) // page_bytes))
        if pages * page_bytes + ckpts * slot_bytes > rest:
            raise ValueError(
                f"num_kv_pages={want.num_kv_pages} / num_checkpoint_slots={want.num_checkpoint_slots} need "
                f"{(pages * page_bytes + ckpts * slot_bytes) / 2**20:.1f} MiB, {rest / 2**20:.1f} MiB are left "
                "after the state slots"
            )
    layout = CacheLayout(
        num_pages=int(pages), page_size=want.page_size, num_slots=int(slots), conv_width=want.conv_width,
        num_checkpoints=int(ckpts),
    )
    full_len = (pages // pages_per_seq) if pages_per_seq else slots
    logger.info(
        "state cache: %d Mamba slots (%.2f MiB each), %d KV pages of %d tokens (%d tokens, %.2f MiB), "
        "%d prefix-cache checkpoint slots (every %d tokens, %.2f MiB); %d concurrent requests fit, %d of them "
        "at max_model_len=%d",
        slots, slot_bytes / 2**20, pages, want.page_size, pages * want.page_size, pages * page_bytes / 2**20,
        ckpts, want.state_block, ckpts * slot_bytes / 2**20, slots, min(slots, full_len), want.max_model_len,
    )
    return layout
