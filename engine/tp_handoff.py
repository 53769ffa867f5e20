"""State handoff (P/D) of a tensor-parallel engine: the wire format stays the unsharded (TP=1) layout, so a
prefill worker of any TP size streams to a decode worker of any TP size and the manifest, digests and data
planes are unchanged.

Export: every rank copies its shard of the request's state (KV heads, conv channels, SSM heads), rank 0
gathers the shards and places them by the shard plan into the global tensors (replicated KV heads / B-C groups
are written by each holder, same values). Commit: rank 0 broadcasts the global tensors and every rank writes
its slice into the reserved pages and slot, which have the same indices on every rank.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.engine import handoff
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.request import Request
from hybridserve.models.parallel import TPGroup
from hybridserve.models.tp_shard import attention_heads, mamba_shards
from hybridserve.statepool.pool import StatePool
from hybridserve.statepool.state_cache import StateCache
from hybridserve.transfer.state_layout import StateTensorSpec, iter_request_state, write_request_state


class TPLeader(Protocol):
    """Rank 0's side of the group as a handoff uses it (engine/tp_worker.py's Leader, which imports this module)."""

    @property
    def tp(self) -> TPGroup: ...
    @property
    def global_config(self) -> ModelConfig: ...

    def send_state_command(self, export: bool, page_ids: list[int], slot: int | None, num_tokens: int) -> None: ...


class TPEngine(Protocol):
    """The parts of `LLMEngine` a tensor-parallel handoff uses (a Protocol: the engine imports this module)."""

    @property
    def tp(self) -> TPLeader | None: ...
    @property
    def cache(self) -> StateCache: ...
    @property
    def pool(self) -> StatePool: ...
    @property
    def config(self) -> EngineConfig: ...

SHARDED = ("kv", "conv", "ssm")


def state_index(name: str, config: ModelConfig, tp: TPGroup) -> tuple[int, torch.Tensor]:
    """(dim, global indices) of this rank's slice of the state tensor `name` (kv [L, 2, n_attn, Hkv, Dh], conv
    [n_mamba, conv_dim, W], ssm [n_mamba, H, P, N])."""
    if name == "kv":
        return 3, torch.tensor(attention_heads(config, tp)[2])
    m = config.mamba
    assert m is not None
    shard = mamba_shards(config, tp.size)[tp.rank]
    heads = torch.arange(shard.head_start, shard.head_start + shard.num_heads)
    if name == "ssm":
        return 1, heads
    inner, gs = m.intermediate_size, m.n_groups * m.state_size
    x = torch.arange(shard.head_start * m.head_dim, (shard.head_start + shard.num_heads) * m.head_dim)
    b = torch.cat([torch.arange(g * m.state_size, (g + 1) * m.state_size) for g in shard.groups])
    return 1, torch.cat([x, inner + b, inner + gs + b])


def global_specs(cache: StateCache, config: ModelConfig, num_tokens: int, hidden_dtype: torch.dtype,
                 size: int) -> list[StateTensorSpec]:
    """The unsharded specs of a request's state, from this rank's shard of the pools."""
    specs = []
    if cache.k_pages.shape[1] and cache.k_pages.shape[0]:
        assert config.attention is not None
        shape = (num_tokens, 2, cache.k_pages.shape[1], config.attention.num_kv_heads, config.attention.head_dim)
        specs.append(StateTensorSpec("kv", cache.k_pages.dtype, shape))
    if cache.conv_states.shape[0]:
        m = config.mamba
        assert m is not None
        n_mamba = cache.conv_states.shape[1]
        specs.append(StateTensorSpec("ssm", cache.ssm_states.dtype, (n_mamba, m.num_heads, m.head_dim, m.state_size)))
        specs.append(StateTensorSpec("conv", cache.conv_states.dtype, (n_mamba, m.conv_dim, cache.conv_states.shape[-1])))
    specs.append(StateTensorSpec("hidden", hidden_dtype, (config.hidden_size,)))
    return specs


def local_state(cache: StateCache, page_ids: list[int], slot: int | None, num_tokens: int) -> dict[str, torch.Tensor]:
    """This rank's shard of a request's state, one stacked tensor per name (copies)."""
    parts: dict[str, list[torch.Tensor]] = {}
    hidden = torch.zeros(1, device=cache.conv_states.device)
    for name, _, part in iter_request_state(cache, page_ids, slot, num_tokens, hidden):
        parts.setdefault(name, []).append(part)
    # kv comes in pieces of tokens, conv / ssm one part per layer
    return {name: torch.cat(p) if name == "kv" else torch.stack(p) for name, p in parts.items() if name in SHARDED}


def gather_state(tp: TPGroup, config: ModelConfig, local: dict[str, torch.Tensor],
                 specs: list[StateTensorSpec]) -> dict[str, torch.Tensor]:
    """Every rank's shard gathered on rank 0 and placed into the global tensors (empty dict on other ranks)."""
    out = {}
    for spec in specs:
        if spec.name not in SHARDED:
            continue
        part = local[spec.name].contiguous()
        parts = [torch.empty_like(part) for _ in range(tp.size)] if tp.rank == 0 else None
        torch.distributed.gather(part, parts, dst=0, group=tp.group)
        if parts is None:
            continue
        full = torch.empty(spec.shape, dtype=spec.dtype, device=part.device)
        for rank, piece in enumerate(parts):
            dim, index = state_index(spec.name, config, TPGroup(rank, tp.size))
            full.index_copy_(dim, index.to(part.device), piece)
        out[spec.name] = full
    return out


def scatter_state(tp: TPGroup, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank 0's global tensors broadcast; this rank's slices of them."""
    local = {}
    for name in SHARDED:
        if name not in tensors:
            continue
        full = tp.broadcast(tensors[name].contiguous())
        dim, index = state_index(name, config, tp)
        local[name] = full.index_select(dim, index.to(full.device))
    return local


def export_state(engine: TPEngine, request: Request, into: dict[str, torch.Tensor] | None) -> handoff.ExportedState:
    """The held request's unsharded state (one part per tensor) on rank 0; releases its pages and slot."""
    leader = engine.tp
    assert leader is not None
    try:
        if request.last_hidden is None:
            raise RuntimeError(f"request {request.request_id} has no hidden state to export")
        num_tokens = request.num_computed_tokens
        specs = state_specs(engine, num_tokens)
        leader.send_state_command(True, request.page_ids, request.state_slot, num_tokens)
        local = local_state(engine.cache, request.page_ids, request.state_slot, num_tokens)
        full = gather_state(leader.tp, leader.global_config, local, specs)
        full["hidden"] = request.last_hidden.clone()
        if into is not None:
            for spec in specs:
                into[spec.name].copy_(full[spec.name])
            full = into
        return handoff.ExportedState(specs, [full[spec.name] for spec in specs], num_tokens)
    finally:
        engine.pool.release(request)


def commit(engine: TPEngine, request: Request, tensors: dict[str, torch.Tensor], first_token: int,
           num_cached_tokens: int) -> None:
    """Install an unsharded received state: every rank writes its slice, then the request decodes."""
    leader = engine.tp
    assert leader is not None
    num_tokens = len(request.prompt_token_ids)
    device = engine.config.torch_device
    on_device = {k: v.to(device) for k, v in tensors.items()}
    if "kv_tail" in on_device:  # an early-sent state's layout (`split_kv_specs`): the ranks take the plain one
        on_device["kv"] = torch.cat([on_device["kv"], on_device.pop("kv_tail")])
    leader.send_state_command(False, request.page_ids, request.state_slot, num_tokens)
    local = scatter_state(leader.tp, leader.global_config, on_device)
    handoff.commit(engine, request, {**local, "hidden": tensors["hidden"]}, first_token, num_cached_tokens)


def state_specs(engine: TPEngine, num_tokens: int) -> list[StateTensorSpec]:
    """The unsharded tensors a request with `num_tokens` computed tokens exchanges."""
    assert engine.tp is not None
    return global_specs(engine.cache, engine.tp.global_config, num_tokens, engine.config.torch_dtype,
                        engine.config.tensor_parallel_size)


def follow_state_command(tp: TPGroup, config: ModelConfig, cache: StateCache, export: bool, page_ids: list[int],
                         slot: int | None, num_tokens: int, hidden_dtype: torch.dtype) -> None:
    """A follower's side of an export (send its shard to rank 0) or a commit (write its slice)."""
    specs = global_specs(cache, config, num_tokens, hidden_dtype, tp.size)
    if export:
        gather_state(tp, config, local_state(cache, page_ids, slot, num_tokens), specs)
        return
    device = cache.conv_states.device
    buffers = {s.name: torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs if s.name in SHARDED}
    local = scatter_state(tp, config, buffers)
    write_request_state(cache, page_ids, slot, num_tokens, local)
