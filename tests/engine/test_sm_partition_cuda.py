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
