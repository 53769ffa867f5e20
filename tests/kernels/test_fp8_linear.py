"""FP8 dense linear (W8A8): the torch reference against full precision, the Triton activation quantization
byte-equal to the reference's (interpreter), and on the GPU `ops.fp8_linear` (Triton + torch._scaled_mm) against
the reference at decode and prefill row counts, eager and in a CUDA graph."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

from hybridserve.kernels.fp8_linear import FP8, FP8_MAX, fp8_linear_ref, quantize_activation_ref, quantize_weight

LAYOUTS = [(False, True), (True, False), (True, True)]  # (per-channel weight scales, static input scale)


def _operands(rows: int, k: int, n: int, per_channel: bool, static: bool, device: str, dtype: torch.dtype,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(x, fp8 weight, weight scale, input scale or None, the full-precision weight)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 3  # rows of unlike ranges
    w = torch.randn(n, k, generator=gen) * 0.05 * (1 + torch.rand(n, 1, generator=gen))
    q, scale = quantize_weight(w, per_channel)
    input_scale = (x.abs().amax() / FP8_MAX).reshape(1) if static else None
    move = {"device": device}
    return (x.to(dtype=dtype, **move), q.to(**move), scale.to(**move),
            None if input_scale is None else input_scale.to(**move), w.to(**move))


@pytest.mark.parametrize("per_channel,static", LAYOUTS)
def test_reference_close_to_full_precision(per_channel: bool, static: bool) -> None:
    x, q, scale, input_scale, w = _operands(7, 96, 48, per_channel, static, "cpu", torch.float32)
    out = fp8_linear_ref(x, q, scale, input_scale)
    ku.assert_close(out, x @ w.t(), 0.08, "fp8 linear vs fp32")  # e4m3: 3 mantissa bits on both operands
    bias = torch.randn(48)
    torch.testing.assert_close(fp8_linear_ref(x[None], q, scale, input_scale, bias)[0], out + bias)


def test_activation_quantization_saturates_and_keeps_zero_rows() -> None:
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 4.0]])
    q, scale = quantize_activation_ref(x)
    assert torch.isfinite(q.float()).all() and (q[0].float() == 0).all()
    assert float(q[1].float().abs().max()) == FP8_MAX and float(scale[1]) == pytest.approx(4.0 / FP8_MAX)
    q, scale = quantize_activation_ref(x * 100, torch.tensor([0.01]))  # past the static range: saturated, not NaN
    assert float(q.float().abs().max()) == FP8_MAX and (scale == 0.01).all()


def test_bad_operands_are_value_errors() -> None:
    x, q, scale, _, _ = _operands(2, 32, 16, True, False, "cpu", torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear_ref(x, q.float(), scale)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_linear_ref(x, q, scale[:3])
    with pytest.raises(ValueError, match="input_scale"):
        fp8_linear_ref(x, q, scale, torch.ones(2))


@ku.interp_only
@pytest.mark.parametrize("cols,static", [(100, False), (100, True), (4500, False)])
def test_triton_quantization_matches_reference_interpreter(cols: int, static: bool) -> None:
    from hybridserve.kernels.fp8_linear_triton import quantize_activation_triton

    torch.manual_seed(cols + static)  # the interpreter's rounding differs from torch's on a few values: fixed data
    x = (torch.randn(3, cols) * torch.tensor([[0.01], [1.0], [300.0]])).to(torch.bfloat16)
    x[0, :] = 0.0 if not static else x[0, :]
    input_scale = torch.tensor([0.05]) if static else None
    q, scale = quantize_activation_triton(x, input_scale)
    q_ref, scale_ref = quantize_activation_ref(x, input_scale)
    assert torch.equal(scale, scale_ref)
    # the interpreter's own fp8 cast is not torch's: it rounds ties and subnormals differently (one e4m3 step) and
    # drops the carry when rounding up to a power of two (127.2 -> 64); the GPU's cvt.rn rounds as torch does
    # (byte-equal in the CUDA test below)
    scaled = torch.clamp(x.float() * (1.0 / scale), -FP8_MAX, FP8_MAX)
    carry = ((q_ref.view(torch.uint8) & 0x7) == 0) & (q_ref.float().abs() > scaled.abs())
    step = (q.float() - q_ref.float()).abs() <= q_ref.float().abs() * 0.125 + 2.0**-9
    assert int(carry.sum()) < x.numel() // 4 and bool((step | carry).all())
    assert float((q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean()) > 0.7


@ku.interp_only
@pytest.mark.parametrize("per_channel,static", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launcher_on_cpu_scaled_mm_interpreter(per_channel: bool, static: bool, dtype: torch.dtype) -> None:
    """Kernel mode "interpret": `ops.fp8_linear` runs the GPU path's launcher on CPU tensors (the Triton
    quantization interpreted, torch's CPU _scaled_mm: tensor-wise and row-wise branches, bias added after)."""
    from hybridserve.kernels import ops
    from hybridserve.kernels.fp8_linear_triton import quantize_activation_triton

    interpret = ops.Kernels("interpret")
    x, q, scale, input_scale, _ = _operands(5, 64, 48, per_channel, static, "cpu", dtype)
    bias = torch.randn(48).to(dtype)
    out = ops.fp8_linear(x, q, scale, input_scale, bias, interpret)
    assert out.dtype == dtype and out.shape == (5, 48)
    # the same fp8 operands as the launcher's (the interpreter's cast is not torch's, see above), fp32 math
    xq, xs = quantize_activation_triton(x, input_scale)
    want = (xq.float() @ q.float().t()) * xs * scale.reshape(1, -1) + bias.float()
    ku.assert_close(out, want, 1e-5 if dtype == torch.float32 else 1e-2, "interpreted fp8 linear")
    odd = _operands(2, 40, 24, per_channel, static, "cpu", dtype)  # K not a multiple of 16: the reference
    torch.testing.assert_close(ops.fp8_linear(*odd[:4], kernels=interpret), fp8_linear_ref(*odd[:4]))


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("per_channel,static", LAYOUTS)
def test_scaled_mm_matches_reference_cuda(per_channel: bool, static: bool) -> None:
    """Nemotron-3-Nano-30B-A3B shapes (Mamba in_proj, out_proj, fused q/k/v) at decode and prefill row counts."""
    from hybridserve.kernels import ops
    from hybridserve.kernels.fp8_linear_triton import quantize_activation_triton, scaled_mm_applies

    for rows in (1, 3, 256, 1000):
        for k, n in ((2688, 10304), (4096, 2688), (2688, 4608)):
            x, q, scale, input_scale, _ = _operands(rows, k, n, per_channel, static, "cuda", torch.bfloat16)
            assert scaled_mm_applies(x, q)
            xq, xs = quantize_activation_triton(x, input_scale)
            xq_ref, xs_ref = quantize_activation_ref(x, input_scale)
            assert torch.equal(xs, xs_ref) and torch.equal(xq.view(torch.uint8), xq_ref.view(torch.uint8))
            out = ops.fp8_linear(x, q, scale, input_scale)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
            ku.assert_close(out, fp8_linear_ref(x, q, scale, input_scale), 1e-2, f"fp8 linear {rows}x{k}->{n}")


@ku.gpu
@ku.cuda_only
def test_scaled_mm_in_a_cuda_graph() -> None:
    from hybridserve.kernels import ops

    x, q, scale, input_scale, _ = _operands(8, 2688, 4608, True, False, "cuda", torch.bfloat16)
    eager = ops.fp8_linear(x, q, scale, input_scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.fp8_linear(x, q, scale, input_scale)
    x.mul_(0.5)
    graph.replay()
    torch.testing.assert_close(captured, ops.fp8_linear(x, q, scale, input_scale), rtol=0, atol=0)
    assert not torch.equal(captured, eager)
    assert q.dtype == FP8
