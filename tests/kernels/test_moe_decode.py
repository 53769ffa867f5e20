"""The one-launch MoE layer (router, up and down tiles as phases of one grid, ordered by ticket counters) against
the three-launch small-M path (same tiles: the same bits), the torch reference and the grouped path; its
counters back at zero after every call and graph replay; the switch back to three launches; bad counters."""

from __future__ import annotations

import ktest_utils as ku  # noqa: I001  (sets TRITON_INTERPRET before triton is imported)
import pytest
import torch

from hybridserve.kernels.moe import moe_layer_ref, quantize_fp8_rows

triton = pytest.importorskip("triton")

from test_moe_small import SHAPES, _layer  # noqa: E402

import hybridserve.kernels.moe_decode_triton as one  # noqa: E402
from hybridserve.kernels.moe_decode_triton import COUNTERS, LaunchCounters  # noqa: E402
from hybridserve.kernels.moe_small_triton import moe_layer_triton  # noqa: E402


def _both(inputs: dict, counters: LaunchCounters) -> tuple[torch.Tensor, torch.Tensor]:
    """(one launch, three launches) of the small path."""
    return (moe_layer_triton(**inputs, small_max_pairs=1 << 20, counters=counters),
            moe_layer_triton(**inputs, small_max_pairs=1 << 20))


@ku.interp_only
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_gives_the_three_launch_bits(shape, dtype):
    tokens, experts, k, n_group, topk_group, d, inter, shared = shape
    inputs = _layer(tokens, experts, k, n_group, topk_group, d, inter, shared, dtype, seed=3 + tokens + experts)
    counters = LaunchCounters.create(torch.device("cpu"))
    for _ in range(2):  # the counters are back at zero, so a second call runs the same way
        single, three = _both(inputs, counters)
        assert torch.equal(single, three)
        assert counters.counts.tolist() == [0] * COUNTERS
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the interpreter truncates fp32 -> bf16
    ku.assert_close(single, moe_layer_ref(**inputs), tol, "one launch vs reference")


@ku.interp_only
def test_one_launch_with_latent_inputs_a_shared_output_and_fp8_experts():
    counters = LaunchCounters.create(torch.device("cpu"))
    inputs = _layer(3, 8, 2, 1, 1, 16, 24, 0, torch.float32, seed=5, latent=40)
    inputs["shared_out"] = torch.randn(3, 16)
    single, three = _both(inputs, counters)
    assert torch.equal(single, three)
    ku.assert_close(single, moe_layer_ref(**inputs), 1e-5, "latent + shared_out")
    inputs = _layer(2, 8, 2, 1, 1, 32, 32, 0, torch.bfloat16, seed=2)
    inputs["w_up"], inputs["up_scale"] = quantize_fp8_rows(inputs["w_up"])
    inputs["w_down"], inputs["down_scale"] = quantize_fp8_rows(inputs["w_down"])
    single, three = _both(inputs, counters)
    assert torch.equal(single, three)
    ku.assert_close(single, moe_layer_ref(**inputs), 3e-2, "fp8 experts")
    assert counters.counts.tolist() == [0] * COUNTERS


@ku.interp_only
def test_switch_and_threshold_pick_the_path(monkeypatch):
    calls = []
    real = one.moe_decode_triton
    monkeypatch.setattr(one, "moe_decode_triton", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    counters = LaunchCounters.create(torch.device("cpu"))
    inputs = _layer(2, 8, 3, 1, 1, 16, 16, 1, torch.float32)  # 4 slots per token
    moe_layer_triton(**inputs, small_max_pairs=8, counters=counters)
    moe_layer_triton(**inputs, small_max_pairs=4, counters=counters)  # 8 pairs: the grouped GEMMs
    monkeypatch.setenv("HYBRIDSERVE_MOE_ONE_LAUNCH", "0")
    moe_layer_triton(**inputs, small_max_pairs=8, counters=counters)
    assert calls == [2]
    monkeypatch.setenv("HYBRIDSERVE_MOE_ONE_LAUNCH", "yes")
    with pytest.raises(ValueError, match="HYBRIDSERVE_MOE_ONE_LAUNCH must be 0 or 1"):
        moe_layer_triton(**inputs, small_max_pairs=8, counters=counters)


@ku.interp_only
def test_bad_counters_name_what_to_change():
    inputs = _layer(1, 8, 2, 1, 1, 16, 16, 0, torch.float32)
    for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros(COUNTERS, dtype=torch.int64)):
        with pytest.raises(ValueError, match="counters must be int32"):
            moe_layer_triton(**inputs, counters=LaunchCounters(bad))


@ku.gpu
@ku.cuda_only
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_one_launch_matches_and_replays_as_a_graph(tokens, fp8):
    """Nano's routing at reduced widths on the GPU (hundreds of programs, so waits really spin): the one launch
    gives the three-launch bits, the reference's values, and the same bits over many CUDA-graph replays."""
    inputs = _layer(tokens, 128, 6, 1, 1, 256, 128, 0 if fp8 else 2, torch.bfloat16, seed=tokens)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs["correction_bias"] = inputs["correction_bias"].float()
    if fp8:
        inputs["w_up"], inputs["up_scale"] = quantize_fp8_rows(inputs["w_up"])
        inputs["w_down"], inputs["down_scale"] = quantize_fp8_rows(inputs["w_down"])
        inputs["shared_out"] = torch.randn(tokens, 256, device="cuda").bfloat16()
    counters = LaunchCounters.create(torch.device("cuda"))
    single, three = _both(inputs, counters)
    ku.assert_close(single, moe_layer_ref(**inputs), 1e-2, "one launch vs reference")
    ku.assert_close(single, three, 1e-2, "one launch vs three launches")  # the autotuners may pick other tiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_layer_triton(**inputs, small_max_pairs=1 << 20, counters=counters)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, single)
    assert counters.counts.tolist() == [0] * COUNTERS
