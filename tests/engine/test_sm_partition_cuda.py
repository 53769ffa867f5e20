"""On a GPU with cuda-python: the green-context lanes keep to their SMs (each lane's programs report their %smid)
and tensors cross lanes. Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_lanes_use_their_own_sms_and_share_tensors() -> None:
    from hybridserve.engine.sm_partition import PartitionUnavailable, open_partitioner

    try:
        part = open_partitioner(torch.device("cuda", 0), (16, 64))
    except PartitionUnavailable as err:
        pytest.skip(f"no green contexts here: {err}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "kernels"))
    from sm_probe import SmProbe

    probe = SmProbe(programs=4096, spin=2000)
    for split in part.splits:
        prefill, decode = part.lanes(split)
        used_p, used_d = set(probe.on(prefill)), set(probe.on(decode))
        assert len(used_p) <= split.prefill_sms and len(used_d) <= split.decode_sms
        assert not used_p & used_d
        with prefill:
            a = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        decode.wait_for(prefill)
        with decode:
            b = a * 2
        decode.synchronize()
        assert torch.equal(b, torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 2)


def test_the_smallest_decode_lane_of_the_auto_menu_runs_cublas_decode_gemms() -> None:
    """A decode lane of one group plus the remainder (12 of an H200's 132 SMs) failed cuBLAS's bf16 GEMMs in served
    steps; lanes keep two groups since. The smallest decode lane the automatic menu gives runs Nano-9B-v2's decode
    projections (bf16, 8 to 128 rows) and agrees with the whole GPU."""
    from hybridserve.engine.config import EngineConfig
    from hybridserve.engine.sm_partition import PartitionUnavailable, open_partitioner

    total = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        part = open_partitioner(torch.device("cuda", 0), EngineConfig().multiplex_menu(total))
    except PartitionUnavailable as err:
        pytest.skip(f"no green contexts here: {err}")
    split = min(part.splits, key=lambda s: s.decode_sms)
    _, decode = part.lanes(split)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n in ((4480, 15680), (15680, 4480), (4480, 22656), (4480, 131072)):  # 9B: MLP up, down, in_proj, lm_head
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for rows in (8, 40, 64, 128):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            want = x @ w
            torch.cuda.synchronize()  # x and w were made on the default stream
            with decode:
                got = x @ w
            decode.synchronize()
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
