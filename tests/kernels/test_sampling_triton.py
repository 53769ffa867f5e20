"""Gumbel-max sampling (kernels/sampling.py, kernels/sampling_triton.py): greedy rows are torch's argmax exactly
(ties, masked tokens, vocabularies over many spans); tempered rows follow softmax(logits / T) (chi-square), never
give a masked token, and depend only on their own logits and seed; the row table refuses bad values."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels.sampling import gumbel_sample_ref, pack_rows, unpack_rows  # noqa: E402
from hybridserve.kernels.sampling_triton import BLOCK, gumbel_sample_triton, spans_for  # noqa: E402

CHI2_CRITICAL_DF6 = 22.46  # chi-square 0.999 quantile, 6 degrees of freedom (8 tokens, one masked)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(inverse_temperatures: list[float], seeds: list[int], device: str = DEVICE) -> torch.Tensor:
    return torch.tensor(pack_rows(inverse_temperatures, seeds), dtype=torch.int32, device=device).view(-1, 2)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_the_row_table_round_trips_and_refuses_bad_values() -> None:
    temperatures, seeds = unpack_rows(_rows([0.0, 1.25, 4.0], [0, 7, (1 << 31) - 1], "cpu"))
    assert temperatures == [0.0, 1.25, 4.0] and seeds == [0, 7, (1 << 31) - 1]
    with pytest.raises(ValueError, match="seed"):
        pack_rows([1.0], [1 << 31])
    with pytest.raises(ValueError, match="inverse temperature"):
        pack_rows([-1.0], [3])
    with pytest.raises(ValueError, match="2 inverse temperatures for 1 seeds"):
        pack_rows([1.0, 2.0], [3])
    with pytest.raises(ValueError, match="rows"):
        gumbel_sample_triton(torch.zeros(2, 8, device=DEVICE), _rows([0.0], [0]))


@pytest.mark.parametrize("vocab", [5, BLOCK, BLOCK + 3, 5 * BLOCK - 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_argmax(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).round(decimals=1).to(dtype)  # rounding makes ties
    logits[1, vocab // 2] = 50.0
    logits[2] = 7.0  # a whole row tied: the first token
    logits[3, :] = float("-inf")  # a whole row masked: token 0, as torch.argmax
    logits[4, : vocab - 1] = float("-inf")  # only the last token left
    logits = logits.to(DEVICE)
    rows = _rows([0.0] * 6, list(range(6)))
    assert spans_for(6, vocab, logits.device)[1] >= 1
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(gumbel_sample_triton(logits, rows), expected)
    assert torch.equal(gumbel_sample_ref(logits, rows), expected)


@pytest.mark.parametrize("sampler", [gumbel_sample_triton, gumbel_sample_ref], ids=["triton", "reference"])
@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_tempered_rows_follow_the_softmax(sampler, temperature: float) -> None:
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(5)) * 2
    logits[0, 3] = float("-inf")  # masked (a grammar, a bad word): never drawn
    draws = 1200
    tokens = sampler(logits.expand(draws, -1).contiguous().to(DEVICE), _rows([1 / temperature] * draws, range(draws)))
    counts = torch.bincount(tokens.cpu(), minlength=8).float()
    probs = torch.softmax(logits[0] / temperature, dim=-1)
    assert counts[3] == 0
    assert _chi_square(counts, probs) < CHI2_CRITICAL_DF6


def test_a_row_depends_only_on_its_logits_and_seed() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 3 * BLOCK + 17, generator=gen).to(DEVICE)
    rows = _rows([1.0, 0.0, 2.0, 1.0, 0.5], [101, 0, 103, 104, 105])
    batch = gumbel_sample_triton(logits, rows)
    alone = torch.cat([gumbel_sample_triton(logits[i : i + 1], rows[i : i + 1]) for i in range(5)])
    assert torch.equal(batch, alone)
    assert torch.equal(gumbel_sample_triton(logits, rows), batch)  # same seeds, same tokens
    other = gumbel_sample_triton(logits, _rows([1.0, 0.0, 2.0, 1.0, 0.5], [201, 0, 203, 204, 205]))
    assert torch.equal(other[1], batch[1]) and not torch.equal(other, batch)  # greedy row unchanged


def test_no_rows() -> None:
    assert gumbel_sample_triton(torch.zeros(0, 9, device=DEVICE), _rows([], [])).shape == (0,)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("num_rows", [1, 5, 64])
def test_a_full_vocabulary_on_the_gpu(num_rows: int) -> None:
    """Nemotron's 131072-token vocabulary in bf16: greedy rows equal argmax, tempered rows spread like the softmax
    of a peaked distribution (the top token's share within 4 sigma)."""
    gen = torch.Generator().manual_seed(num_rows)
    logits = torch.randn(num_rows, 131072, generator=gen).to("cuda", torch.bfloat16)
    rows = _rows([0.0] * num_rows, list(range(num_rows)), "cuda")
    assert torch.equal(gumbel_sample_triton(logits, rows), logits.float().argmax(dim=-1))
    peaked = torch.full((4096, 131072), -4.0, device="cuda")
    peaked[:, 7] = 4.0
    share = float(torch.softmax(peaked[0], dim=-1)[7])
    tokens = gumbel_sample_triton(peaked, _rows([1.0] * 4096, list(range(4096)), "cuda"))
    hits = float((tokens == 7).float().mean())
    assert abs(hits - share) < 4 * (share * (1 - share) / 4096) ** 0.5
