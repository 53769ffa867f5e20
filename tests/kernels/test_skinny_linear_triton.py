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
