"""Triton residual add + RMSNorm and relu2 against their torch references (interpreter on CPU, compiled on GPU).

The new residual and relu2 must equal the reference bit for bit (same fp32 math, same rounding) on the GPU;
Triton's interpreter truncates fp32 -> bf16 casts (the compiled kernels round to nearest even), so there a bf16
result may sit one bf16 ulp below the reference. The normed rows must be within the dtype's tolerance. Outputs
are poisoned with NaN so a row or column the kernel skips shows up.
"""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from hybridserve.kernels.gated_rmsnorm import add_rmsnorm_ref, relu2_ref, rmsnorm_ref  # noqa: E402
from hybridserve.kernels.gated_rmsnorm_triton import add_rmsnorm_triton, relu2_triton  # noqa: E402

EPS = 1e-5


def _assert_same(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Bit for bit, but within one bf16 ulp for bf16 results under the interpreter (it truncates casts)."""
    if ku.INTERPRETING and got.dtype == torch.bfloat16:
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=0.0, equal_nan=True, msg=what)
    else:
        assert torch.equal(got.nan_to_num(7.0), ref.nan_to_num(7.0)), what


def _inputs(rows: int, dim: int, x_dtype: torch.dtype, r_dtype: torch.dtype, w_dtype: torch.dtype,
            device: str, gen: torch.Generator, strided: bool = False) -> tuple[torch.Tensor, ...]:
    """x [rows, dim] (a column slice of a wider buffer when `strided`), residual, weight."""
    wide = torch.randn(rows, dim + 5, generator=gen).to(device=device, dtype=x_dtype)
    x = wide[:, 2 : 2 + dim] if strided else wide[:, :dim].contiguous()
    residual = (4 * torch.randn(rows, dim, generator=gen)).to(device=device, dtype=r_dtype)
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device=device, dtype=w_dtype)
    return x, residual, weight


def _check_add_rmsnorm(rows: int, dim: int, x_dtype: torch.dtype, r_dtype: torch.dtype, w_dtype: torch.dtype,
                       device: str, gen: torch.Generator, strided: bool = False) -> None:
    """Triton vs reference into poisoned buffers, then allocated outputs and the in-place residual update."""
    x, residual, weight = _inputs(rows, dim, x_dtype, r_dtype, w_dtype, device, gen, strided)
    ref_normed, ref_residual = add_rmsnorm_ref(x, residual, weight, EPS)
    out = ku.poisoned((rows, dim), w_dtype, device)
    res_out = ku.poisoned((rows, dim), r_dtype, device)
    normed, new_residual = add_rmsnorm_triton(x, residual, weight, EPS, out=out, residual_out=res_out)
    assert normed.data_ptr() == out.data_ptr() and new_residual.data_ptr() == res_out.data_ptr()
    what = f"rows={rows} dim={dim} x={x_dtype} residual={r_dtype} weight={w_dtype}"
    assert normed.dtype == w_dtype and new_residual.dtype == r_dtype, what
    _assert_same(new_residual, ref_residual, f"new residual: {what}")
    rounded = {torch.promote_types(x_dtype, r_dtype), w_dtype}  # dtypes the norm's input was rounded to
    ku.assert_close(normed, ref_normed, ku.TOL[torch.bfloat16] if torch.bfloat16 in rounded else 1e-5, what)
    # allocated outputs and the in-place residual update give the same rows
    normed2, residual2 = add_rmsnorm_triton(x, residual, weight, EPS)
    assert torch.equal(normed2, normed) and torch.equal(residual2, new_residual), what
    in_place = residual.clone()
    _, residual3 = add_rmsnorm_triton(x, in_place, weight, EPS, residual_out=in_place)
    assert residual3.data_ptr() == in_place.data_ptr() and torch.equal(in_place, new_residual), what


def _check_relu2(shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    """relu2 reference and Triton vs torch.square(F.relu(x)), NaN and signed zeros included, in place too."""
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    x.view(-1)[:3] = torch.tensor([float("nan"), -0.0, 0.0], dtype=dtype)
    ref = torch.square(F.relu(x))
    assert torch.equal(relu2_ref(x).nan_to_num(7.0), ref.nan_to_num(7.0))
    out = ku.poisoned(shape, dtype, device)
    out.view(-1)[0] = 0.0  # the NaN input must still come out NaN
    got = relu2_triton(x, out=out)
    assert got.data_ptr() == out.data_ptr()
    _assert_same(got, ref, f"relu2 {shape} {dtype}")
    assert torch.isnan(got.view(-1)[0])
    in_place = x.clone()
    assert torch.equal(relu2_triton(in_place, out=in_place).nan_to_num(7.0), got.nan_to_num(7.0))
    strided = x.t() if x.dim() == 2 else x
    _assert_same(relu2_triton(strided), torch.square(F.relu(strided)), f"relu2 strided {shape} {dtype}")


def test_add_rmsnorm_ref_is_the_unfused_block() -> None:
    """The reference is bit for bit the unfused pre-norm block: (residual + x).to(weight dtype) -> rmsnorm."""
    gen = torch.Generator().manual_seed(0)
    for x_dtype, r_dtype, w_dtype in [(torch.float32,) * 3, (torch.bfloat16, torch.float32, torch.bfloat16),
                                      (torch.bfloat16,) * 3, (torch.float32, torch.bfloat16, torch.float32)]:
        x, residual, weight = _inputs(5, 33, x_dtype, r_dtype, w_dtype, "cpu", gen)
        hidden = residual + x
        normed, new_residual = add_rmsnorm_ref(x, residual, weight, EPS)
        assert torch.equal(new_residual, hidden.to(r_dtype))
        assert torch.equal(normed, rmsnorm_ref(hidden.to(w_dtype), weight, EPS))


@ku.interp_only
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r_dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_interpreter(x_dtype: torch.dtype, r_dtype: torch.dtype) -> None:
    """Every dtype mix the model uses, odd widths, 1..37 rows, a strided x, a weight of another dtype."""
    gen = torch.Generator().manual_seed(1)
    w_dtype = x_dtype  # the model's norms and hidden states share one dtype
    for rows, dim in [(1, 70), (3, 257), (37, 64), (2, 448)]:
        _check_add_rmsnorm(rows, dim, x_dtype, r_dtype, w_dtype, "cpu", gen)
    _check_add_rmsnorm(5, 70, x_dtype, r_dtype, w_dtype, "cpu", gen, strided=True)
    _check_add_rmsnorm(4, 70, x_dtype, r_dtype, torch.float32 if w_dtype == torch.bfloat16 else torch.bfloat16,
                       "cpu", gen)


@ku.interp_only
def test_add_rmsnorm_interpreter_edge_cases() -> None:
    """No rows, 3-D inputs, and the shape / dtype checks."""
    gen = torch.Generator().manual_seed(2)
    x, residual, weight = _inputs(0, 70, torch.float32, torch.float32, torch.float32, "cpu", gen)
    normed, new_residual = add_rmsnorm_triton(x, residual, weight, EPS)
    assert normed.shape == (0, 70) and new_residual.shape == (0, 70)
    x, residual, weight = _inputs(6, 70, torch.float32, torch.float32, torch.float32, "cpu", gen)
    ref = add_rmsnorm_ref(x.view(2, 3, 70), residual.view(2, 3, 70), weight, EPS)
    got = add_rmsnorm_triton(x.view(2, 3, 70), residual.view(2, 3, 70), weight, EPS)
    ku.assert_close(got[0], ref[0], 1e-5, "3-D rows")
    assert torch.equal(got[1], ref[1])
    with pytest.raises(ValueError, match="residual shape"):
        add_rmsnorm_triton(x, residual[:, :69], weight, EPS)
    with pytest.raises(ValueError, match="out must be"):
        add_rmsnorm_triton(x, residual, weight, EPS, out=torch.empty(6, 70, dtype=torch.bfloat16))


@ku.interp_only
def test_relu2_interpreter() -> None:
    """Odd sizes spanning several programs, fp32 and bf16, empty input."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(1, 70), (3, 257), (37, 1100), (2500,)]:
        for dtype in (torch.float32, torch.bfloat16):
            _check_relu2(shape, dtype, "cpu", gen)
    assert relu2_triton(torch.empty(0, 5)).shape == (0, 5)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("r_dtype", [torch.bfloat16, torch.float32])
def test_add_rmsnorm_gpu(dtype: torch.dtype, r_dtype: torch.dtype) -> None:
    """Compiled kernel at the Nemotron-Nano-9B-v2 hidden size (4480) and others."""
    gen = torch.Generator().manual_seed(4)
    for rows, dim in [(1, 4480), (37, 4480), (3, 257), (1000, 4480), (5, 12288)]:
        _check_add_rmsnorm(rows, dim, dtype, r_dtype, dtype, "cuda", gen)
    _check_add_rmsnorm(7, 4480, dtype, r_dtype, dtype, "cuda", gen, strided=True)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_relu2_gpu(dtype: torch.dtype) -> None:
    """Compiled kernel at the Nemotron-Nano-9B-v2 MLP width (15680)."""
    gen = torch.Generator().manual_seed(5)
    for shape in [(1, 15680), (37, 15680), (1000, 15680), (3, 257)]:
        _check_relu2(shape, dtype, "cuda", gen)
