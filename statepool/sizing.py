"""One memory plan for the state cache: running requests first, the prefix cache in what they cannot use.

The budget holds Mamba state rows (one per running or standby request) and KV pages. Running requests get
memory first: as many rows as `max_num_seqs` (+ standby) asks while each request keeps KV for `plan_seq_len`
tokens (fewer rows, with a WARNING, when the budget cannot hold that many: more rows would only take the KV
that lets requests run, so raising `max_num_seqs` never shrinks the KV the running batch gets below that).
KV beyond what the rows' requests can ever use (each at max_model_len) becomes prefix cache: cached KV and
checkpoint rows of its own, in the ratio a cached prefix needs them (one state per `state_block` tokens).
Everything else the cache holds lives in memory running requests do not use right now: cached KV blocks in
free pages (evicted when a request needs a page) and checkpoints in idle running rows (`CheckpointAllocator`'s
lender, evicted when a request needs the row), so the cache never holds capacity a running request waits for.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.statepool.state_cache import CacheLayout

logger = logging.getLogger(__name__)

GIB = 1 << 30
# KV a running request keeps before another Mamba row is planned (the length most chat / benchmark requests
# stay under: 1K prompt + 1K answer); `plan_seq_len` changes it
DEFAULT_PLAN_SEQ_LEN = 2048
CPU_MEMORY_SHARE = 0.25  # the most of the host's memory the CPU budget that follows the model may take


def gpu_budget_bytes(device: torch.device, gpu_memory_utilization: float, reserved_bytes: int) -> int:
    """The utilization share of the whole GPU less what is in use now (weights, CUDA context, other processes)
    and `reserved_bytes` (activations and graphs, measured by the engine's profiling pass)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total * gpu_memory_utilization) - (total - free) - reserved_bytes)


def request_bytes(config: ModelConfig, want: PoolRequest) -> int:
    """One request's state at max_model_len: its Mamba slot and its KV pages."""
    slot = CacheLayout.bytes_per_slot(config, want.conv_width, want.dtype, want.ssm_dtype)
    page = CacheLayout.bytes_per_page(config, want.page_size, want.dtype)
    return slot + -(-want.max_model_len // want.page_size) * page


def useful_bytes(config: ModelConfig, want: PoolRequest) -> int:
    """The most state memory the plan can put to use: every row's request at max_model_len, twice over with
    prefix caching (as much again for the cache). A small model on a big GPU takes this, not the whole share,
    so that several engines (tests, a second model) fit on one device."""
    copies = 2 if want.prefix_caching else 1
    return (want.max_num_seqs + want.standby_slots) * request_bytes(config, want) * copies


def cpu_budget_bytes(config: ModelConfig, want: PoolRequest) -> int:
    """A CPU budget that follows the model and max_num_seqs (`useful_bytes`), at most CPU_MEMORY_SHARE of the
    host's memory."""
    per_request = request_bytes(config, want)
    need = useful_bytes(config, want)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return need
    return max(min(need, int(host * CPU_MEMORY_SHARE)), per_request)


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
    num_checkpoint_slots: int | None = None  # checkpoint rows of their own (idle running rows come on top)
    standby_slots: int = 0  # state slots beyond max_num_seqs (requests outside the running batch)
    plan_seq_len: int | None = None  # KV tokens each planned row's request keeps; None: DEFAULT_PLAN_SEQ_LEN

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
        if self.plan_seq_len is not None and self.plan_seq_len <= 0:
            raise ValueError(f"plan_seq_len must be positive, got {self.plan_seq_len}")

    @property
    def planned_len(self) -> int:
        return min(self.max_model_len, self.plan_seq_len or DEFAULT_PLAN_SEQ_LEN)


def _rows(want: PoolRequest, fit: int) -> tuple[int, int]:
    """(running, standby) rows when `fit` requests fit: running first, standby from what is left."""
    running = max(1, min(want.max_num_seqs, fit))
    return running, max(0, min(want.standby_slots, fit - running))


def plan_cache_layout(config: ModelConfig, budget_bytes: int, want: PoolRequest) -> CacheLayout:
    """Rows, KV pages and checkpoint rows for `want` in `budget_bytes` (see the module docstring); logs what
    fits at INFO and a lowered max_num_seqs at WARNING."""
    slot = CacheLayout.bytes_per_slot(config, want.conv_width, want.dtype, want.ssm_dtype)
    page = CacheLayout.bytes_per_page(config, want.page_size, want.dtype)
    pages_of = (lambda tokens: -(-tokens // want.page_size)) if page else (lambda tokens: 0)
    full_pages = pages_of(want.max_model_len)
    fixed_ckpts = want.num_checkpoint_slots or 0
    min_pages = full_pages if want.num_kv_pages is None else want.num_kv_pages
    if slot + min_pages * page + fixed_ckpts * slot > budget_bytes:
        raise ValueError(
            f"one request of max_model_len={want.max_model_len} needs {(slot + min_pages * page) / 2**20:.1f} MiB "
            f"of state (+ {fixed_ckpts * slot / 2**20:.1f} MiB of num_checkpoint_slots), the state-cache budget is "
            f"{budget_bytes / 2**20:.1f} MiB: raise cpu_memory_gb / gpu_memory_utilization / gpu_memory_gb or "
            "lower max_model_len"
        )
    rows_budget = budget_bytes - fixed_ckpts * slot
    if want.num_kv_pages is not None:  # the rows get what the fixed KV leaves
        fit = (rows_budget - want.num_kv_pages * page) // max(slot, 1) if slot else want.max_num_seqs
    else:  # every row's request keeps KV for planned_len tokens
        fit = rows_budget // max(1, slot + pages_of(want.planned_len) * page)
    asked = want.max_num_seqs + want.standby_slots
    running, standby = _rows(want, int(fit)) if slot else (want.max_num_seqs, want.standby_slots)
    if running + standby < asked:
        logger.warning(
            "max_num_seqs=%d (+%d standby slots) lowered to %d (+%d): each request needs a Mamba state slot of "
            "%.1f MiB and KV for %s tokens (%.1f MiB), and %.2f GiB of state cache hold %d of them; raise "
            "gpu_memory_utilization / gpu_memory_gb, or lower plan_seq_len to run more, shorter requests",
            want.max_num_seqs, want.standby_slots, running, standby, slot / 2**20, f"{want.planned_len:,}",
            pages_of(want.planned_len) * page / 2**20, budget_bytes / GIB, int(fit),
        )
    rows = running + standby
    rest = rows_budget - rows * slot
    ckpts = fixed_ckpts
    if want.num_kv_pages is not None:
        pages = want.num_kv_pages
    elif not page:
        pages = 0
    else:
        usable = rows * full_pages  # the most KV the rows' requests can ever hold
        pages = min(rest // page, usable) if not want.prefix_caching else rest // page
        if want.prefix_caching and want.num_checkpoint_slots is None and slot and pages > usable:
            # KV past what running requests can use is cache: a checkpoint row per state_block cached tokens
            surplus = rest - usable * page
            ckpts = surplus // (pages_of(want.state_block) * page + slot)
            pages = (rest - ckpts * slot) // page
    if want.prefix_caching and want.num_checkpoint_slots is None and not page and slot:
        ckpts = max(0, rest // slot)  # Mamba-only: what the rows leave holds cached states
    layout = CacheLayout(num_pages=int(pages), page_size=want.page_size, num_slots=int(rows),
                         conv_width=want.conv_width, num_checkpoints=int(ckpts))
    logger.info("%s", describe_plan(layout, want, slot, page, running))
    return layout


def describe_plan(layout: CacheLayout, want: PoolRequest, slot_bytes: int, page_bytes: int, running: int) -> str:
    """The start-up line that says what fits."""
    total = layout.num_slots * slot_bytes + layout.num_pages * page_bytes + layout.num_checkpoints * slot_bytes
    tokens = layout.num_pages * layout.page_size

    def concurrency(length: int) -> int:
        if not page_bytes:
            return running
        return min(running, layout.num_pages // -(-length // layout.page_size))

    lengths = sorted({want.planned_len, want.max_model_len})
    fits = ", ".join(f"{concurrency(n):,}" + (" requests" if i == 0 else "") + f" of {n:,}" + (" tokens" if i == 0 else "")
                     for i, n in enumerate(lengths))
    standby = layout.num_slots - running
    ckpt = "prefix cache off"
    if want.prefix_caching:
        ckpt = (f"prefix-cache checkpoints (every {want.state_block:,} tokens) in {layout.num_checkpoints:,} rows of "
                f"their own ({layout.num_checkpoints * slot_bytes / GIB:.1f} GiB) and in idle slots")
    return (
        f"state cache {total / GIB:.1f} GiB: {layout.num_slots:,} Mamba slots ({slot_bytes / 2**20:.1f} MiB each; "
        f"{running:,} running + {standby:,} standby), {tokens:,} KV tokens ({layout.num_pages * page_bytes / GIB:.1f} "
        f"GiB), {ckpt}; maximum concurrency {fits}"
    )
