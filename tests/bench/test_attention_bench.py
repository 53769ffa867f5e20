"""The attention benchmark compares like with like: on the CPU (fp32, tiny shapes) every variant it times returns
the same output as `paged_attention_ref` on the same inputs."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # our Triton kernel runs in the interpreter (before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attention as bench_attention  # noqa: E402  (bench/kernels/ is on pytest's pythonpath)

from hybridserve.kernels.paged_attention import gather_kv, paged_attention_ref  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _inputs(batch: int, T: int, kv_len: int, seed: int) -> bench_attention.AttnInputs:
    return bench_attention.make_inputs(batch, T, kv_len, hq=10, hkv=2, dh=16, page=4, dtype=torch.float32,
                                       device="cpu", seed=seed)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("batch,T,kv_len", [(1, 1, 13), (3, 1, 16), (2, 4, 13), (3, 4, 9), (1, 20, 31)])
def test_every_variant_matches_reference(batch: int, T: int, kv_len: int) -> None:
    """Decode (T=1), verify (T=4) and a prefill (T=20 > 16: our prefill path) on a cached prefix."""
    inp = _inputs(batch, T, kv_len, seed=batch * 100 + T)
    ref = paged_attention_ref(*inp.ref_args())
    names = [n for n in bench_attention.VARIANTS if n != "ours" or INTERPRETING]
    for name, build in bench_attention.variant_fns(inp, compiled_flex=False).items():
        if name not in names:
            continue
        out = build()()
        assert out.shape == ref.shape, name
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_contiguous_kv_is_the_paged_kv() -> None:
    """The contiguous copy holds each sequence's keys / values in token order, as the reference reads them."""
    inp = _inputs(3, 4, 14, seed=5)
    for seq in range(3):
        keys = gather_kv(inp.k_pages, inp.block_tables[seq], inp.kv_len)  # [kv_len, Hkv, Dh]
        values = gather_kv(inp.v_pages, inp.block_tables[seq], inp.kv_len)
        assert torch.equal(inp.k[seq].transpose(0, 1), keys)
        assert torch.equal(inp.v[seq].transpose(0, 1), values)
    assert sorted(inp.block_tables.flatten().tolist()) == list(range(inp.block_tables.numel()))  # scattered pages


def test_io_bytes() -> None:
    """K + V bytes read and q + out bytes of one call (the floor's numerator)."""
    inp = _inputs(2, 4, 13, seed=1)
    kv, qo = bench_attention.io_bytes(inp)
    assert kv == 2 * 2 * 2 * 13 * 16 * 4
    assert qo == 2 * 2 * 4 * 10 * 16 * 4
