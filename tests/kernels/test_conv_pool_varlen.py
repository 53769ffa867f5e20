"""Varlen causal conv1d reading / writing its windows straight in the conv state pool (`conv_pool`, `slots`,
`boundary_rows`), reference and Triton, against the same call without a pool (gather + scatter by hand)."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels.causal_conv1d import causal_conv1d_varlen_ref  # noqa: E402
from hybridserve.kernels.causal_conv1d_triton import causal_conv1d_varlen_triton  # noqa: E402

IMPLS = {"ref": causal_conv1d_varlen_ref, "triton": causal_conv1d_varlen_triton}

# (length, start position) per sequence; with state_block 4 they cross 0, 1, 2, 2 (the last at the very end),
# 0 and 1 boundaries; the short resumed ones take most of their windows from the initial window
SEQS = [(3, 0), (4, 5), (9, 2), (8, 0), (1, 6), (1, 3)]


def _representable(values: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """Under the interpreter, values exact in the pool dtype: its fp32 -> bf16 cast truncates where torch and
    the GPU round to nearest even, so only exact copies compare equal there."""
    return values.to(pool_dtype).float() if ku.INTERPRETING else values


def _pool(rows: int, channels: int, width: int, dtype: torch.dtype, layout: str, device: str,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(backing tensor, a strided [rows, D, W] pool view of it), like a per-layer view of the engine's pool."""
    if layout == "slice":  # [rows, layers, D, W + 2] -> layer 1, columns 1 .. W
        big = torch.randn(rows, 3, channels, width + 2, generator=gen).to(device=device, dtype=dtype)
        return big, big[:, 1, :, 1 : 1 + width]
    if layout == "transposed":  # width-major rows: W stride D, D stride 1
        big = torch.randn(rows, width, channels, generator=gen).to(device=device, dtype=dtype)
        return big, big.transpose(1, 2)
    big = torch.randn(rows, channels, width, generator=gen).to(device=device, dtype=dtype)
    return big, big


def _check_pool_path(
    impl: str,
    seqs: list[tuple[int, int]],
    channels: int,
    kernel: int,
    width: int,
    x_dtype: torch.dtype,
    pool_dtype: torch.dtype,
    layout: str,
    device: str,
    gen: torch.Generator,
    state_block: int | None = 4,
    with_boundary_rows: bool = True,
    with_starts: bool = True,
) -> None:
    """Run `impl` with the pool and without (windows gathered / scattered by hand); compare y and the pool."""
    fn = IMPLS[impl]
    lens = [n for n, _ in seqs]
    starts = torch.tensor([s if with_starts else 0 for _, s in seqs], device=device)
    num_seqs = len(seqs)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)
    proj = _representable(torch.randn(sum(lens), channels + 5, generator=gen), pool_dtype).to(device, x_dtype)
    x = proj[:, 3 : 3 + channels]  # a strided column slice, like xBC from in_proj
    weight = torch.randn(channels, kernel, generator=gen).to(device=device, dtype=x_dtype)
    bias = torch.randn(channels, generator=gen).to(device=device, dtype=x_dtype)
    kw = dict(start_positions=starts if with_starts else None, state_block=state_block)

    # the old path: initial windows gathered from the pool, outputs returned as fp32 tensors
    block = state_block or 1
    num_rows = 2 * num_seqs + sum((s + n) // block - s // block for n, s in seqs) + 3  # spare rows stay untouched
    big, pool = _pool(num_rows, channels, width, pool_dtype, layout, device, gen)
    perm = torch.randperm(num_rows, generator=gen).to(device)
    slots = perm[:num_seqs]
    resumed = starts > 0
    old_windows = torch.where(resumed[:, None, None], pool[slots].float(), 0.0)
    old = fn(x, weight, bias, cu, old_windows, **kw)
    num_bounds = old.boundary_seq.numel()
    boundary_rows = perm[num_seqs : num_seqs + num_bounds].clone()
    boundary_rows[1::3] = -1  # some boundaries are not kept
    dropped = perm[num_seqs : num_seqs + num_bounds][1::3]

    # poison what must be written (fresh sequences' slots, kept boundary rows) and the rows of dropped
    # boundaries (must stay NaN); resumed slots keep their windows since they are read first
    pool[slots[~resumed]] = float("nan")
    pool[boundary_rows[boundary_rows >= 0]] = float("nan")
    pool[dropped] = float("nan")
    expected_big = big.clone()
    expected = _pool_view_like(expected_big, big, pool)
    expected[slots] = old.final_windows.to(pool_dtype)
    if with_boundary_rows:
        keep = boundary_rows >= 0
        expected[boundary_rows[keep]] = old.boundary_windows[keep].to(pool_dtype)

    new = fn(x, weight, bias, cu, conv_pool=pool, slots=slots,
             boundary_rows=boundary_rows if with_boundary_rows else None, **kw)
    if ku.INTERPRETING:
        assert torch.equal(new.y, old.y), f"{impl}: y differs from the no-pool path"
    else:
        ku.assert_close(new.y, old.y, 1e-6, f"{impl}: y")
    # every element of the backing tensor: written rows as the old path, everything else untouched
    torch.testing.assert_close(big, expected_big, rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"{impl}: pool differs from the no-pool path: {m}")
    assert new.final_windows.shape == (0, channels, width) and new.boundary_windows.shape == (0, channels, width)
    assert torch.equal(new.boundary_seq.cpu(), old.boundary_seq.cpu())
    assert torch.equal(new.boundary_pos.cpu(), old.boundary_pos.cpu())


def _pool_view_like(target: torch.Tensor, big: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """The view of `target` that `pool` is of `big` (same offset and strides)."""
    offset = pool.storage_offset() - big.storage_offset()
    return target.as_strided(pool.shape, pool.stride(), target.storage_offset() + offset)


def _check_both_impls_agree(seqs: list[tuple[int, int]], channels: int, kernel: int, width: int,
                            pool_dtype: torch.dtype, device: str, gen: torch.Generator, tol: float) -> None:
    """The Triton pool path writes the same pool as the reference pool path (up to rounding)."""
    lens = [n for n, _ in seqs]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)
    starts = torch.tensor([s for _, s in seqs], device=device)
    x = _representable(torch.randn(sum(lens), channels, generator=gen), pool_dtype).to(device)
    weight = torch.randn(channels, kernel, generator=gen).to(device)
    bias = torch.randn(channels, generator=gen).to(device)
    num_bounds = causal_conv1d_varlen_ref(x, weight, bias, cu, None, window_width=width, start_positions=starts,
                                          state_block=4).boundary_seq.numel()
    # rows: 2 per sequence (slots at the even ones), then one per boundary, then spare rows nobody may touch
    pool = torch.randn(2 * len(lens) + num_bounds + 8, channels, width, generator=gen).to(device=device,
                                                                                          dtype=pool_dtype)
    slots = torch.arange(len(lens), device=device) * 2
    rows = torch.arange(num_bounds, device=device) + 2 * len(lens)
    rows[::2] = -1
    pools = []
    for fn in (causal_conv1d_varlen_ref, causal_conv1d_varlen_triton):
        p = pool.clone()
        fn(x, weight, bias, cu, start_positions=starts, state_block=4, conv_pool=p, slots=slots, boundary_rows=rows)
        pools.append(p)
    ku.assert_close(pools[1], pools[0], tol, "triton pool vs reference pool")


@ku.interp_only
@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("width", [3, 6])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_conv_pool_matches_gather_scatter_interpreter(impl: str, width: int, pool_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    for layout in ("slice", "transposed", "contiguous"):
        _check_pool_path(impl, SEQS, 6, 4, width, torch.float32, pool_dtype, layout, "cpu", gen)
    # no boundary rows (boundaries not written), no state_block, every sequence fresh (nothing read)
    _check_pool_path(impl, SEQS, 6, 4, width, torch.float32, pool_dtype, "slice", "cpu", gen,
                     with_boundary_rows=False)
    _check_pool_path(impl, SEQS, 6, 4, width, torch.float32, pool_dtype, "slice", "cpu", gen,
                     state_block=None, with_boundary_rows=False)
    _check_pool_path(impl, SEQS, 6, 4, width, torch.float32, pool_dtype, "slice", "cpu", gen, with_starts=False)


@ku.interp_only
def test_conv_pool_triton_agrees_with_reference_interpreter() -> None:
    gen = torch.Generator().manual_seed(4)
    _check_both_impls_agree(SEQS, 5, 4, 5, torch.float32, "cpu", gen, 1e-6)
    _check_both_impls_agree(SEQS, 5, 4, 3, torch.bfloat16, "cpu", gen, 1e-6)


@ku.interp_only
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_conv_pool_argument_errors(impl: str) -> None:
    fn = IMPLS[impl]
    x, weight, bias = torch.randn(10, 4), torch.randn(4, 4), torch.randn(4)
    cu, starts = torch.tensor([0, 3, 10]), torch.tensor([0, 2])  # crosses position 4 and 8: two boundaries
    pool = torch.randn(8, 4, 3)
    before = pool.clone()
    slots = torch.tensor([0, 1])
    kw = dict(start_positions=starts, state_block=4)
    with pytest.raises(ValueError, match="not both"):
        fn(x, weight, bias, cu, torch.zeros(2, 4, 3), conv_pool=pool, slots=slots, **kw)
    with pytest.raises(ValueError, match="slots"):
        fn(x, weight, bias, cu, conv_pool=pool, **kw)
    with pytest.raises(ValueError, match="slots"):
        fn(x, weight, bias, cu, conv_pool=pool, slots=torch.tensor([0, 1, 2]), **kw)
    with pytest.raises(ValueError, match="slots"):
        fn(x, weight, bias, cu, conv_pool=pool, slots=torch.tensor([0.0, 1.0]), **kw)
    with pytest.raises(ValueError, match="conv_pool"):
        fn(x, weight, bias, cu, slots=slots, **kw)
    with pytest.raises(ValueError, match="conv_pool"):
        fn(x, weight, bias, cu, conv_pool=torch.randn(8, 5, 3), slots=slots, **kw)
    with pytest.raises(ValueError, match="window_width"):
        fn(x, weight, bias, cu, window_width=5, conv_pool=pool, slots=slots, **kw)
    with pytest.raises(ValueError, match="conv_kernel-1"):
        fn(x, weight, bias, cu, conv_pool=torch.randn(8, 4, 2), slots=slots, **kw)
    with pytest.raises(ValueError, match="boundary_rows"):
        fn(x, weight, bias, cu, conv_pool=pool, slots=slots, boundary_rows=torch.tensor([4, 5, 6]), **kw)
    with pytest.raises(ValueError, match="boundary_rows"):
        fn(x, weight, bias, cu, conv_pool=pool, slots=slots, boundary_rows=torch.tensor([[4, 5]]), **kw)
    assert torch.equal(pool, before), "a rejected call wrote into the pool"
    fn(x, weight, bias, cu, conv_pool=pool, slots=slots, boundary_rows=torch.tensor([4, -1]), **kw)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_conv_pool_matches_gather_scatter_gpu(impl: str, x_dtype: torch.dtype, pool_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    seqs = [(1000, 0), (37, 300), (513, 129), (256, 256), (3, 254), (700, 1)]
    for width, layout in ((6, "slice"), (3, "transposed"), (3, "contiguous")):
        _check_pool_path(impl, seqs, 4352, 4, width, x_dtype, pool_dtype, layout, "cuda", gen, state_block=256)
    _check_pool_path(impl, seqs, 4352, 4, 6, x_dtype, pool_dtype, "slice", "cuda", gen, state_block=None,
                     with_boundary_rows=False)
    _check_pool_path(impl, seqs, 4352, 4, 6, x_dtype, pool_dtype, "slice", "cuda", gen, state_block=256,
                     with_starts=False)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_conv_pool_triton_agrees_with_reference_gpu(pool_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    seqs = [(1000, 0), (37, 300), (513, 129), (3, 2)]
    _check_both_impls_agree(seqs, 12288, 4, 6, pool_dtype, "cuda", gen, 1e-6)
