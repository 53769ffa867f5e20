"""Token sampling: greedy, or temperature + top-k + top-p, batched on the logits' device. A request's samples
never depend on what else is in the batch: rows with plain temperature take a token by Gumbel-max from a seed
drawn from the request's own CPU generator (`kernels.ops.gumbel_sample`: one pass over the vocabulary, two
launches on CUDA); rows with top-k / top-p draw a uniform from it and pick by inverse CDF over the filtered
distribution. Per row only a few bytes cross to the device."""

from __future__ import annotations

import torch

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.kernels.host_index import pack_to_device
from hybridserve.kernels.ops import AUTO_KERNELS, SEED_BITS, Kernels, gumbel_sample, pack_rows


def processed_probs(
    logits: torch.Tensor,  # [R, V]
    temperature: torch.Tensor,  # [R] > 0
    top_k: torch.Tensor,  # [R] int, <= 0 or >= V: off
    top_p: torch.Tensor,  # [R] in (0, 1]
) -> torch.Tensor:
    """The distribution each row samples from, fp32 [R, V]: logits / temperature; keep the top-k logits (ties
    with the k-th kept); then drop a token when the tokens ranked above it already reach top_p."""
    scaled = logits.float() / temperature[:, None]
    vocab = scaled.shape[-1]
    ordered, order = torch.sort(scaled, dim=-1, descending=True)  # [R, V]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    kth = ordered.gather(1, (k - 1)[:, None])  # [R, 1]
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a stream sync (torch.tensor(..., device=) waits for the device;
    pinned, so the copy queues behind a step still in flight under async scheduling)."""
    if device.type != "cuda":
        return pack_to_device([values], dtype, device)[0]
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def _filters(param: SamplingParams, vocab: int) -> bool:
    """Whether a (non-greedy) row narrows its distribution by top-k or top-p."""
    return 0 < param.top_k < vocab or param.top_p < 1.0


def params_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """processed_probs with one SamplingParams per row (all non-greedy). Rows without top-k and top-p (the
    default) skip the sort over the vocabulary: their distribution is the tempered softmax itself."""
    device = logits.device
    temperature = _to_device([p.temperature for p in params], torch.float32, device)
    vocab = logits.shape[-1]
    if not any(_filters(p, vocab) for p in params):
        return torch.softmax(logits.float() / temperature[:, None], dim=-1)
    top_k = _to_device([p.top_k for p in params], torch.int64, device)
    top_p = _to_device([p.top_p for p in params], torch.float32, device)
    return processed_probs(logits, temperature, top_k, top_p)


def target_probs(logits: torch.Tensor, param: SamplingParams) -> torch.Tensor:
    """The distribution one request samples from: logits [..., V] -> probs [..., V] fp32, same device."""
    rows = logits.reshape(-1, logits.shape[-1])
    return params_probs(rows, [param] * rows.shape[0]).reshape(logits.shape)


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [R, V] by inverse CDF, each row's uniform from its own CPU generator -> [R]."""
    uniforms = torch.stack([torch.rand((), generator=g) for g in generators])
    if probs.is_cuda:
        uniforms = uniforms.pin_memory()  # queued behind the device's work, as `_to_device`
    uniforms = uniforms.to(probs.device, non_blocking=True)
    cdf = torch.cumsum(probs, dim=-1)
    # the first index whose cdf exceeds u * total: never a zero-probability token
    index = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)
    return index[:, 0].clamp(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           kernels: Kernels = AUTO_KERNELS) -> list[int]:
    """logits: [B, V], one row per request -> one token id per row (`kernels`: the engine's kernel mode)."""
    return sample_tensor(logits, params, generators, kernels).tolist()


def sample_tensor(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                  kernels: Kernels = AUTO_KERNELS) -> torch.Tensor:
    """`sample` left on the logits' device, int64 [B], without a host sync (async scheduling feeds it to the next
    step's input there)."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    # plain-temperature rows: Gumbel-max with a fresh seed from the request's generator; greedy and filtered rows
    # ride along as argmax rows (the filtered ones are drawn below)
    plain = [not p.greedy and not _filters(p, vocab) for p in params]
    filtered = [i for i, (p, keep) in enumerate(zip(params, plain)) if not p.greedy and not keep]
    inverse_temperatures = [1.0 / p.temperature if keep else 0.0 for p, keep in zip(params, plain)]
    seeds = [int(torch.randint(1 << SEED_BITS, (), generator=g)) if keep else 0 for g, keep in zip(generators, plain)]
    rows = _to_device(pack_rows(inverse_temperatures, seeds), torch.int32, logits.device).view(-1, 2)
    tokens = gumbel_sample(logits, rows, kernels=kernels)
    if filtered:
        index = _to_device(filtered, torch.int64, logits.device)
        probs = params_probs(logits[index], [params[i] for i in filtered])
        tokens[index] = draw(probs, [generators[i] for i in filtered])
    return tokens
