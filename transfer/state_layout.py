"""One request's whole state as named tensors: what a prefill worker exports and a decode worker imports.

  kv.k, kv.v : [n_attention_layers, L, Hkv, Dh]   the prompt's keys / values (attention layers only)
  conv       : [n_mamba_layers, conv_dim, W]        conv windows after the prompt
  ssm        : [n_mamba_layers, H, P, N]            SSM states after the prompt
  hidden     : [hidden_size]                        last prompt token's final hidden state (for MTP drafting)
Each tensor is sent as per-layer parts, in this order, so copying layer i+1 overlaps sending layer i.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hybridserve.statepool.state_cache import StateCache


@dataclass(frozen=True)
class StateTensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def request_state_specs(
    cache: StateCache, num_tokens: int, hidden_size: int, hidden_dtype: torch.dtype
) -> list[StateTensorSpec]:
    """The tensors of a request with `num_tokens` computed tokens, in transfer order."""
    specs: list[StateTensorSpec] = []
    n_attn = cache.k_pages.shape[1]
    if n_attn and cache.k_pages.shape[0]:
        kv_shape = (n_attn, num_tokens, *cache.k_pages.shape[3:])
        specs += [StateTensorSpec("kv.k", cache.k_pages.dtype, kv_shape), StateTensorSpec("kv.v", cache.v_pages.dtype, kv_shape)]
    if cache.conv_states.shape[0]:
        specs.append(StateTensorSpec("conv", cache.conv_states.dtype, tuple(cache.conv_states.shape[1:])))
        specs.append(StateTensorSpec("ssm", cache.ssm_states.dtype, tuple(cache.ssm_states.shape[1:])))
    specs.append(StateTensorSpec("hidden", hidden_dtype, (hidden_size,)))
    return specs


def _token_index(page_ids: list[int], num_tokens: int, page_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of tokens 0..num_tokens-1 in the request's pages."""
    positions = torch.arange(num_tokens, device=device)
    pages = torch.tensor(page_ids, dtype=torch.int64, device=device)[positions // page_size]
    return pages, positions % page_size


def iter_request_state(
    cache: StateCache, page_ids: list[int], slot: int | None, num_tokens: int, hidden: torch.Tensor
) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(tensor name, layer, device tensor) parts in transfer order; each a copy that stays valid after the
    request's pages and slot are released."""
    n_attn = cache.k_pages.shape[1]
    if n_attn and cache.k_pages.shape[0]:
        pages, offsets = _token_index(page_ids, num_tokens, cache.layout.page_size, cache.k_pages.device)
        for name, pool in (("kv.k", cache.k_pages), ("kv.v", cache.v_pages)):
            for layer in range(n_attn):
                yield name, layer, pool[pages, layer, offsets]  # [L, Hkv, Dh]
    if cache.conv_states.shape[0]:
        if slot is None:
            raise ValueError("the model has Mamba layers but the request holds no state slot")
        for name, pool in (("conv", cache.conv_states), ("ssm", cache.ssm_states)):
            for layer in range(pool.shape[1]):
                yield name, layer, pool[slot, layer].clone()  # a copy: the slot is reused once released
    yield "hidden", 0, hidden.clone()


def write_request_state(
    cache: StateCache, page_ids: list[int], slot: int | None, num_tokens: int, tensors: dict[str, torch.Tensor]
) -> None:
    """Copy received tensors into the request's reserved pages and slot (the commit of a transfer)."""
    if "kv.k" in tensors:
        pages, offsets = _token_index(page_ids, num_tokens, cache.layout.page_size, cache.k_pages.device)
        for name, pool in (("kv.k", cache.k_pages), ("kv.v", cache.v_pages)):
            source = tensors[name].to(device=pool.device, dtype=pool.dtype)  # [n_attn, L, Hkv, Dh]
            for layer in range(pool.shape[1]):
                pool[pages, layer, offsets] = source[layer]
    if "conv" in tensors:
        if slot is None:
            raise ValueError("the model has Mamba layers but the request holds no state slot")
        cache.conv_states[slot] = tensors["conv"].to(device=cache.conv_states.device, dtype=cache.conv_states.dtype)
        cache.ssm_states[slot] = tensors["ssm"].to(device=cache.ssm_states.device, dtype=cache.ssm_states.dtype)


def state_nbytes(specs: list[StateTensorSpec]) -> int:
    """Bytes of the whole state: its tensors concatenated in transfer order."""
    return sum(spec.nbytes for spec in specs)


def state_views(buffer: torch.Tensor, specs: list[StateTensorSpec]) -> dict[str, torch.Tensor]:
    """The named tensors of a state laid out back to back in a flat uint8 buffer (views, no copies where the
    offsets are element-aligned, which arena ranges and the transfer order guarantee for these dtypes)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < state_nbytes(specs):
        raise ValueError(f"a state of {state_nbytes(specs)} bytes needs a flat uint8 buffer at least that long")
    tensors: dict[str, torch.Tensor] = {}
    start = 0
    for spec in specs:
        raw = buffer[start : start + spec.nbytes]
        if (raw.storage_offset()) % torch.empty((), dtype=spec.dtype).element_size():
            raw = raw.clone()  # dtype views need element-aligned offsets
        tensors[spec.name] = raw.view(spec.dtype).reshape(spec.shape)
        start += spec.nbytes
    return tensors


def stage_request_state(
    cache: StateCache, page_ids: list[int], slot: int | None, num_tokens: int, hidden: torch.Tensor,
    out: dict[str, torch.Tensor],
) -> None:
    """Copy a request's state into `out` (views of a staging buffer, from `state_views`): queued device
    copies, no host sync; the pages and slot may be released right after (later writes queue behind)."""
    n_attn = cache.k_pages.shape[1]
    if "kv.k" in out:
        pages, offsets = _token_index(page_ids, num_tokens, cache.layout.page_size, cache.k_pages.device)
        for name, pool in (("kv.k", cache.k_pages), ("kv.v", cache.v_pages)):
            for layer in range(n_attn):
                out[name][layer].copy_(pool[pages, layer, offsets])  # [L, Hkv, Dh]
    if "conv" in out:
        if slot is None:
            raise ValueError("the model has Mamba layers but the request holds no state slot")
        out["conv"].copy_(cache.conv_states[slot])
        out["ssm"].copy_(cache.ssm_states[slot])
    out["hidden"].copy_(hidden)
