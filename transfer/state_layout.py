"""One request's whole state as named tensors: what a prefill worker exports and a decode worker imports.

  kv     : [L, 2, n_attention_layers, Hkv, Dh]   the prompt's keys (0) / values (1), token-major (attention
                                                  layers only)
  ssm    : [n_mamba_layers, H, P, N]              SSM states after the prompt
  conv   : [n_mamba_layers, conv_dim, W]          conv windows after the prompt
  hidden : [hidden_size]                          last prompt token's final hidden state (for MTP drafting)
KV comes first and token-major, then the SSM states layer-major, the conv windows and the hidden state. Loose
parts are cut in pieces so copying piece i+1 overlaps sending piece i.
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
        specs.append(StateTensorSpec("kv", cache.k_pages.dtype, (num_tokens, 2, n_attn, *cache.k_pages.shape[3:])))
    if cache.conv_states.shape[0]:
        specs.append(StateTensorSpec("ssm", cache.ssm_states.dtype, tuple(cache.ssm_states.shape[1:])))
        specs.append(StateTensorSpec("conv", cache.conv_states.dtype, tuple(cache.conv_states.shape[1:])))
    specs.append(StateTensorSpec("hidden", hidden_dtype, (hidden_size,)))
    return specs


def _token_index(page_ids: list[int], num_tokens: int, page_size: int, device: torch.device,
                 start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of tokens start..num_tokens-1 in the request's pages."""
    positions = torch.arange(start, num_tokens, device=device)
    needed = page_ids[: -(-num_tokens // page_size)]
    pages = torch.tensor(needed, dtype=torch.int64, device=device)[positions // page_size]
    return pages, positions % page_size


def stage_kv_rows(cache: StateCache, page_ids: list[int], start: int, end: int, out: torch.Tensor) -> None:
    """Copy the keys / values of prompt tokens start..end-1 into `out` [end - start, 2, n_attn, Hkv, Dh]
    (queued device copies: one gather per pool)."""
    if out.shape[0] != end - start:
        raise ValueError(f"{out.shape[0]} kv rows given for tokens {start}..{end - 1}")
    if end == start:
        return
    pages, offsets = _token_index(page_ids, end, cache.layout.page_size, cache.k_pages.device, start)
    out[:, 0].copy_(cache.k_pages[pages, :, offsets])  # [rows, n_attn, Hkv, Dh]
    out[:, 1].copy_(cache.v_pages[pages, :, offsets])


def iter_request_state(
    cache: StateCache, page_ids: list[int], slot: int | None, num_tokens: int, hidden: torch.Tensor
) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(tensor name, layer, device tensor) parts in transfer order; each a copy that stays valid after the
    request's pages and slot are released."""
    n_attn = cache.k_pages.shape[1]
    if n_attn and cache.k_pages.shape[0]:
        kv = torch.empty((num_tokens, 2, n_attn, *cache.k_pages.shape[3:]), dtype=cache.k_pages.dtype,
                         device=cache.k_pages.device)  # [L, 2, n_attn, Hkv, Dh]
        stage_kv_rows(cache, page_ids, 0, num_tokens, kv)
        rows = max(1, -(-num_tokens // max(n_attn, 4)))  # a few pieces: D2H of one overlaps sending another
        for index, piece in enumerate(kv.split(rows)):
            yield "kv", index, piece
    if cache.conv_states.shape[0]:
        if slot is None:
            raise ValueError("the model has Mamba layers but the request holds no state slot")
        for name, pool in (("ssm", cache.ssm_states), ("conv", cache.conv_states)):
            for layer in range(pool.shape[1]):
                yield name, layer, pool[slot, layer].clone()  # a copy: the slot is reused once released
    yield "hidden", 0, hidden.clone()


def write_request_state(
    cache: StateCache, page_ids: list[int], slot: int | None, num_tokens: int, tensors: dict[str, torch.Tensor]
) -> None:
    """Copy received tensors into the request's reserved pages and slot (the commit of a transfer)."""
    if "kv" in tensors:
        pages, offsets = _token_index(page_ids, tensors["kv"].shape[0], cache.layout.page_size, cache.k_pages.device)
        source = tensors["kv"].to(device=cache.k_pages.device, dtype=cache.k_pages.dtype)  # [L, 2, n_attn, Hkv, Dh]
        cache.k_pages[pages, :, offsets] = source[:, 0]  # [L, n_attn, Hkv, Dh] scattered into the pages
        cache.v_pages[pages, :, offsets] = source[:, 1]
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
    if "kv" in out:
        stage_kv_rows(cache, page_ids, 0, num_tokens, out["kv"])
    if ("conv" in out or "ssm" in out) and slot is None:
        raise ValueError("the model has Mamba layers but the request holds no state slot")
    if "ssm" in out:
        out["ssm"].copy_(cache.ssm_states[slot])
    if "conv" in out:
        out["conv"].copy_(cache.conv_states[slot])
    out["hidden"].copy_(hidden)
