"""Skinny Triton linear (decode projections) against torch's linear, and the `ops.linear` dispatch."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

pytest.importorskip("triton")

from hybridserve.kernels import ops  # noqa: E402
from hybridserve.kernels.skinny_linear_triton import (  # noqa: E402
    MAX_ROWS,
    SplitKWorkspace,
    gated_norm_linear_ref,
    gated_norm_linear_triton,
    norm_fits,
    skinny_linear_ref,
    skinny_linear_triton,
)


def _case(shape_x, out_features, bias, dtype, device, gen):
    x = torch.randn(*shape_x, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(out_features, shape_x[-1], generator=gen) * 0.05).to(device=device, dtype=dtype)
    b = torch.randn(out_features, generator=gen).to(device=device, dtype=dtype) if bias else None
    return x, w, b


@ku.interp_only
@pytest.mark.parametrize("shape_x,out_features,bias", [
    ((1, 70), 40, True),  # a K tail (70 = 2 x 32 + 6) and an N tail (40 = 2 x 16 + 8)
    ((3, 64), 33, False),
    ((2, 2, 48), 16, True),  # leading batch dims
    ((MAX_ROWS, 100), 20, True),  # the full 16-row tile
    ((0, 32), 8, False),  # no rows
])
def test_skinny_linear_interpreter(shape_x, out_features, bias):
    gen = torch.Generator().manual_seed(sum(shape_x) + out_features)
    x, w, b = _case(shape_x, out_features, bias, torch.float32, "cpu", gen)
    out = skinny_linear_triton(x, w, b)
    assert out.shape == (*shape_x[:-1], out_features)
    if x.numel():
        ku.assert_close(out, skinny_linear_ref(x, w, b), 1e-5, "y")


@ku.interp_only
@pytest.mark.parametrize("shape_x,out_features,bias", [
    ((1, 70), 40, True),  # 8 splits over 3 K blocks: most splits have no K at all and store zeros
    ((5, 300), 33, False),  # 10 K blocks over 8 splits, an N tail
    ((MAX_ROWS, 64), 20, True),
])
def test_skinny_linear_split_k_interpreter(shape_x, out_features, bias):
    """With a workspace the interpreter runs the largest K-split: partials meet in the workspace, the last
    program of each column block writes y, and every arrival count is back at 0 for the next call."""
    gen = torch.Generator().manual_seed(sum(shape_x) + out_features)
    x, w, b = _case(shape_x, out_features, bias, torch.float32, "cpu", gen)
    workspace = SplitKWorkspace.create(out_features, torch.device("cpu"))
    for _ in range(2):  # a second call finds the scratch reset
        ku.assert_close(skinny_linear_triton(x, w, b, workspace), skinny_linear_ref(x, w, b), 1e-5, "y")
        assert int(workspace.arrivals.abs().sum()) == 0


def test_skinny_linear_errors():
    x, w = torch.zeros(2, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_linear_triton(torch.zeros(17, 8), w)
    with pytest.raises(ValueError, match="does not match weight"):
        skinny_linear_triton(torch.zeros(2, 9), w)
    with pytest.raises(ValueError, match="cast one of them"):
        skinny_linear_triton(x.double(), w)
    with pytest.raises(ValueError, match="bias must be"):
        skinny_linear_triton(x, w, torch.zeros(5))
    with pytest.raises(ValueError, match="split-K workspace is for 5 columns"):
        skinny_linear_triton(x, w, None, SplitKWorkspace.create(5, torch.device("cpu")))


def test_ops_linear_on_cpu_is_torch():
    gen = torch.Generator().manual_seed(0)
    x, w, b = _case((3, 24), 10, True, torch.float32, "cpu", gen)
    assert torch.equal(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("out_features,in_features", [(22656, 4480), (4480, 10240), (4480, 15680), (1000, 72)])
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_linear_gpu(out_features, in_features, rows, dtype):
    """Nemotron-Nano-9B-v2's mamba in_proj, out_proj and MLP down_proj, and a small odd shape."""
    gen = torch.Generator().manual_seed(rows)
    x, w, b = _case((rows, in_features), out_features, True, dtype, "cuda", gen)
    ref = skinny_linear_ref(x.float(), w.float(), b.float())
    ku.assert_close(skinny_linear_triton(x, w, b), ref, ku.TOL[dtype], "y")
    # ops.linear takes the Triton kernel for large weights, cuBLAS otherwise; both agree with the reference
    ku.assert_close(ops.linear(x, w, b), ref, ku.TOL[dtype], "ops.linear")
    many = x.repeat(MAX_ROWS // rows + 1, 1)  # more rows than the kernel takes: cuBLAS
    ku.assert_close(ops.linear(many, w, b)[:rows], ref, ku.TOL[dtype], "ops.linear, more rows")


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("out_features,in_features", [(2688, 4096), (256, 2688), (4096, 2688)])
@pytest.mark.parametrize("rows", [1, 4])
def test_skinny_linear_split_k_gpu(out_features, in_features, rows):
    """Nemotron-3-Nano-30B-A3B's mamba out_proj, k_proj and q_proj (few output columns: K is split): equal to
    the reference, bit-identical from call to call and through CUDA-graph replays (the sum is in split order)."""
    gen = torch.Generator().manual_seed(rows)
    x, w, _ = _case((rows, in_features), out_features, False, torch.bfloat16, "cuda", gen)
    workspace = SplitKWorkspace.create(out_features, x.device)
    first = skinny_linear_triton(x, w, None, workspace)
    ku.assert_close(first, skinny_linear_ref(x.float(), w.float()), ku.TOL[torch.bfloat16], "y")
    for _ in range(3):
        assert torch.equal(skinny_linear_triton(x, w, None, workspace), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear_triton(x, w, None, workspace)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    assert int(workspace.arrivals.abs().sum()) == 0


def _gated_case(rows, channels, out_features, bias, gen):
    """x and its gate as column slices of one in_proj-like output (row stride > channels), as the mixer has them."""
    projected = torch.randn(rows, 2 * channels + 5, generator=gen)
    z, x = projected[:, :channels], projected[:, channels + 5:]
    norm_weight = 1.0 + 0.1 * torch.randn(channels, generator=gen)
    w = torch.randn(out_features, channels, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen) if bias else None
    return x, z, norm_weight, w, b


@ku.interp_only
@pytest.mark.parametrize("rows,channels,group_size,out_features,bias,split", [
    (1, 128, 32, 40, True, False),  # 4 groups, one K block each, an N tail
    (3, 192, 96, 33, False, True),  # 8 splits of one K block: each split's group reaches over its neighbours'
    (MAX_ROWS, 64, 64, 20, True, True),  # one group over the row, every split a part of it
    (2, 96, 32, 16, False, True),  # 3 groups (GROUPS rounds up to 4), splits past the last block
])
def test_gated_norm_linear_matches_the_norm_then_linear(rows, channels, group_size, out_features, bias, split):
    """The fused kernel's output equals the gated norm followed by the linear, with and without a K-split."""
    gen = torch.Generator().manual_seed(rows + channels + group_size)
    x, z, norm_weight, w, b = _gated_case(rows, channels, out_features, bias, gen)
    workspace = SplitKWorkspace.create(out_features, torch.device("cpu")) if split else None
    expected = gated_norm_linear_ref(x, z, norm_weight, group_size, 1e-5, w, b)
    for _ in range(2):  # a second call finds the split-K scratch reset
        got = gated_norm_linear_triton(x, z, norm_weight, group_size, 1e-5, w, b, workspace)
        assert got.shape == (rows, out_features)
        ku.assert_close(got, expected, 1e-5, "y")
    # the same weight without the norm still goes through the plain path of the shared kernel
    ku.assert_close(skinny_linear_triton(x.contiguous(), w, b, workspace), skinny_linear_ref(x, w, b), 1e-5, "plain")


def test_gated_norm_linear_errors_and_fit():
    x, z, nw, w = torch.zeros(2, 64), torch.zeros(2, 64), torch.ones(64), torch.zeros(8, 64)
    with pytest.raises(ValueError, match="gate shape"):
        gated_norm_linear_triton(x, torch.zeros(2, 32), nw, 32, 1e-5, w)
    with pytest.raises(ValueError, match="norm weight must be"):
        gated_norm_linear_triton(x, z, torch.ones(32), 32, 1e-5, w)
    with pytest.raises(ValueError, match="use gated_rmsnorm, then linear"):
        gated_norm_linear_triton(x, z, nw, 48, 1e-5, w)  # 48 does not divide 64
    assert not norm_fits(64, 0) and not norm_fits(96, 48)


def test_ops_gated_norm_linear_on_cpu_is_the_norm_then_linear():
    gen = torch.Generator().manual_seed(3)
    x, z, norm_weight, w, b = _gated_case(2, 64, 12, True, gen)
    expected = torch.nn.functional.linear(ops.gated_rmsnorm(x, z, norm_weight, group_size=32, eps=1e-5), w, b)
    assert torch.equal(ops.gated_norm_linear(x, z, norm_weight, 32, 1e-5, w, b), expected)


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("hidden,channels,group_size", [(2688, 4096, 512), (4480, 10240, 1280)])
@pytest.mark.parametrize("rows", [1, 4])
def test_gated_norm_linear_gpu(hidden, channels, group_size, rows):
    """Nemotron-3-Nano-30B-A3B's and Nano-9B-v2's Mamba norm + out_proj, bf16: the fused launch against the norm's
    kernel then the skinny linear (the same rounding of the normed input to bf16; sums in another order)."""
    gen = torch.Generator().manual_seed(rows)
    x, z, norm_weight, w, _ = (t.to("cuda", torch.bfloat16) if t is not None else None
                               for t in _gated_case(rows, channels, hidden, False, gen))
    workspace = SplitKWorkspace.create(hidden, x.device)
    unfused = ops.linear(ops.gated_rmsnorm(x, z, norm_weight, group_size=group_size, eps=1e-5), w, None, workspace)
    fused = gated_norm_linear_triton(x, z, norm_weight, group_size, 1e-5, w, None, workspace)
    ku.assert_close(fused, unfused, ku.TOL[torch.bfloat16], "fused")
    assert torch.equal(gated_norm_linear_triton(x, z, norm_weight, group_size, 1e-5, w, None, workspace), fused)
