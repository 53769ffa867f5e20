"""Sampling a token per row by the Gumbel-max trick: argmax(logits / T + G), G ~ Gumbel(0, 1) i.i.d. per token,
is a draw from softmax(logits / T) (exactly, not approximately), and it needs no normalisation, no cumulative sum
and no search: one pass over the vocabulary. Greedy rows (inverse temperature 0) take the plain argmax (first index
among equal maxima, as torch.argmax). Each row's noise comes from its own seed, so a row's token depends only on its
logits and its seed, never on the rest of the batch.

Rows are described by one int32 pair each (`pack_rows`): the inverse temperature's float32 bits and a 31-bit seed,
so a step moves them to the device in one small copy. The reference draws its noise with torch's CPU generator, the
Triton kernel (`sampling_triton.py`) with Philox: the same distribution, not the same tokens for a seed.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

SEED_BITS = 31  # seeds are non-negative int32 (the Philox key of the kernel, a manual_seed here)


def pack_rows(inverse_temperatures: Sequence[float], seeds: Sequence[int]) -> list[int]:
    """[inv_t bits, seed] per row, flattened: the int32 row table `gumbel_sample` reads (inv_t 0: greedy)."""
    if len(inverse_temperatures) != len(seeds):
        raise ValueError(f"{len(inverse_temperatures)} inverse temperatures for {len(seeds)} seeds")
    out: list[int] = []
    for inv_t, seed in zip(inverse_temperatures, seeds):
        if not 0 <= seed < 1 << SEED_BITS:
            raise ValueError(f"seed {seed} is outside [0, 2**{SEED_BITS})")
        if not inv_t >= 0.0:
            raise ValueError(f"inverse temperature {inv_t} must be >= 0 (0: greedy)")
        out += [struct.unpack("<i", struct.pack("<f", inv_t))[0], seed]
    return out


def unpack_rows(rows: torch.Tensor) -> tuple[list[float], list[int]]:
    """The inverse temperatures and seeds of an int32 row table [R, 2] (host copy)."""
    table = rows.reshape(-1, 2).cpu()
    return table[:, 0].contiguous().view(torch.float32).tolist(), table[:, 1].tolist()


def gumbel_sample_ref(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (any float dtype), rows [R, 2] int32 from `pack_rows` -> token ids [R] int64, same device."""
    if logits.dim() != 2 or rows.shape != (logits.shape[0], 2):
        raise ValueError(f"logits [R, V] and rows [R, 2] expected, got {tuple(logits.shape)} and {tuple(rows.shape)}")
    inverse_temperatures, seeds = unpack_rows(rows)
    keys = logits.to("cpu", torch.float32, copy=True)  # [R, V]; a copy: the caller's logits stay as they are
    for row, (inv_t, seed) in enumerate(zip(inverse_temperatures, seeds)):
        if inv_t == 0.0:
            continue  # greedy: the logits themselves
        uniform = torch.rand(logits.shape[1], generator=torch.Generator().manual_seed(seed))  # [V] in [0, 1)
        keys[row] = keys[row] * inv_t - torch.log(-torch.log(uniform))  # u = 0: -inf, never drawn
    return keys.argmax(dim=-1).to(logits.device)
