"""Which SMs a launch ran on: a Triton kernel whose programs write their `%smid` (SM-partition checks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridserve.engine.sm_partition import Lane


@triton.jit
def _smid_kernel(sm_ptr, acc_ptr, spin):
    """Each program spins `spin` dependent FMAs, then writes the id of the SM it ran on."""
    pid = tl.program_id(0)
    ids = pid + tl.zeros([1], dtype=tl.int32)
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [ids], dtype=tl.int32, is_pure=False, pack=1)
    acc = ids.to(tl.float32)
    for _ in range(spin):
        acc = acc * 0.999 + 1.0
    offs = pid + tl.arange(0, 1)
    tl.store(sm_ptr + offs, smid)
    tl.store(acc_ptr + offs, acc)


class SmProbe:
    """Launches the %smid kernel and reads back the set of SMs it ran on."""

    def __init__(self, programs: int = 8192, spin: int = 4000) -> None:
        self.programs, self.spin = programs, spin
        self.sm = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
        self.acc = torch.zeros(programs, dtype=torch.float32, device="cuda")

    def launch(self) -> None:
        _smid_kernel[(self.programs,)](self.sm, self.acc, self.spin, num_warps=1)

    def used(self) -> list[int]:
        torch.cuda.synchronize()
        sms = sorted(set(self.sm.tolist()))
        self.sm.fill_(-1)
        torch.cuda.synchronize()
        return sms

    def on(self, lane: Lane | None) -> list[int]:
        if lane is None:
            self.launch()
        else:
            with lane:
                self.launch()
        return self.used()
