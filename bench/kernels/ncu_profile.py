"""Hardware-counter profile (Nsight Compute) of the kernel-table kernels whose targets are not met: what bounds them.

    python bench/kernels/ncu_profile.py --out bench/results/<device>/kernels/ncu_profile.json [--cases ssd-nano ssu-fp32-256 ...]

Each case runs in its own `ncu` child (`--case NAME`): inputs are made and every kernel is compiled and autotuned
first, then one call runs between cudaProfilerStart / Stop, so only that call's kernels are replayed under the
counters. Per kernel the JSON keeps the time, DRAM bytes and throughput, L2 traffic, SM / memory "speed of
light", registers, occupancy, issue activity and the warp-stall breakdown (cycles per issued instruction), and
the summary printed at the end names the largest stalls. Clocks are left alone (`--clock-control none`).
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_table import CONFIGS, STATE_BLOCK, _peer_step, _ssu_inputs, ssd_inputs  # noqa: E402
from peer import load_peer  # noqa: E402
from sections import write_json  # noqa: E402

from hybridserve.kernels.replay_state import ReplayCache  # noqa: E402
from hybridserve.kernels.replay_state_update import replay_state_update_triton  # noqa: E402
from hybridserve.kernels.ssd_scan_meta import chunk_metadata  # noqa: E402
from hybridserve.kernels.ssd_scan_triton import ssd_scan_varlen_triton  # noqa: E402
from hybridserve.kernels.state_update_triton import (  # noqa: E402
    multi_token_state_update_triton,
    selective_state_update_triton,
)

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats")
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum",
           "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio")
SSD_CASES = {"ssd-nano": ("nemotron-nano-9b-v2", 1, 8192), "ssd-2.7b": ("mamba2-2.7b", 1, 8192)}
SSU_CASES = {"ssu-fp32-128": (torch.float32, 128), "ssu-fp32-256": (torch.float32, 256),
             "ssu-bf16-256": (torch.bfloat16, 256)}
VERIFY_CASES = {"verify-replay-128": 128, "verify-intermediate-128": 128}  # T = 4, fp32 state, ours only
CASES = [f"{name}-{side}" for name in (*SSD_CASES, *SSU_CASES) for side in ("ours", "peer")]
CASES += [f"{name}-ours" for name in VERIFY_CASES]


def case_fn(case: str) -> Callable[[], Any]:
    """The one call a case profiles (inputs made here; the caller warms it up)."""
    name, side = case.rsplit("-", 1)
    peer = load_peer() if side == "peer" else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    if name in SSD_CASES:
        config, num_seqs, seqlen = SSD_CASES[name]
        heads, head_dim, groups, state, chunk = CONFIGS[config]
        x, dt, A, B, C, D, bias, cu = ssd_inputs(heads, head_dim, groups, state, num_seqs, seqlen, gen)
        if peer is None:
            meta = chunk_metadata(cu, None, chunk, STATE_BLOCK, x.device)
            return lambda: ssd_scan_varlen_triton(x, dt, A, B, C, cu, chunk, D=D, dt_bias=bias,
                                                  state_block=STATE_BLOCK, meta=meta)
        xb, dtb, Bb, Cb = (t.view(num_seqs, seqlen, *t.shape[1:]) for t in (x, dt, B, C))
        return lambda: peer["mamba_chunk_scan_combined"](xb, dtb, A, Bb, Cb, chunk, D=D, dt_bias=bias,
                                                         dt_softplus=True, return_final_states=True)
    if name in SSU_CASES:
        state_dtype, batch = SSU_CASES[name]
        t = _ssu_inputs(batch, 1, state_dtype, gen)
        if peer is None:
            return lambda: selective_state_update_triton(
                t["pool"], t["slots"], t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0], D=t["D"],
                dt_bias=t["bias"], z=t["z"][:, 0])
        return _peer_step(peer, t, 0)
    if name in VERIFY_CASES and peer is None:
        return _verify_fn(name, VERIFY_CASES[name], gen)
    raise ValueError(f"unknown case {case!r}; choose from {CASES}")


def _verify_fn(name: str, batch: int, gen: torch.Generator, tokens: int = 4) -> Callable[[], Any]:
    """A T-token verify step as bench/kernels/kernel_table.py times it: replay (2 of the last 4 tokens accepted) or the
    intermediate-state method writing every token's state."""
    t = _ssu_inputs(batch, tokens, torch.float32, gen)
    kw = dict(D=t["D"], dt_bias=t["bias"], z=t["z"])
    if name == "verify-intermediate-128":
        inter = torch.empty(batch, tokens, *t["pool"].shape[1:], device="cuda", dtype=torch.float32)
        return lambda: multi_token_state_update_triton(t["pool"], t["slots"], t["x"], t["dt"], t["A"], t["B"],
                                                       t["C"], intermediate_states=inter, write_final_state=False,
                                                       **kw)
    heads, head_dim, groups, state, _ = CONFIGS["nemotron-nano-9b-v2"]
    cache = ReplayCache.allocate(batch, tokens, heads, head_dim, groups, state, torch.bfloat16, "cuda")
    accepted = torch.full((batch,), 2, dtype=torch.int32, device="cuda")
    return lambda: replay_state_update_triton(t["pool"], cache, t["slots"], accepted, t["x"], t["dt"], t["A"],
                                              t["B"], t["C"], **kw)


def run_case(case: str) -> None:
    """Child side: warm up (compile, autotune), then one profiled call."""
    fn = case_fn(case)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def find_ncu() -> str:
    """The ncu binary: on the PATH, else the newest under /opt/nvidia/nsight-compute."""
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)),
                                        None)
    if found is None:
        raise SystemExit("ncu (Nsight Compute) not found on the PATH or under /opt/nvidia/nsight-compute")
    return found


def _number(text: str) -> float | str:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_details(text: str) -> list[dict[str, Any]]:
    """`ncu --import ... --csv --page details` rows -> one dict per kernel launch: name, grid, block, metrics."""
    kernels: dict[str, dict[str, Any]] = {}
    for row in csv.DictReader(io.StringIO(text)):
        if not row.get("ID"):
            continue
        kernel = kernels.setdefault(row["ID"], {"kernel": row["Kernel Name"], "grid": row.get("Grid Size"),
                                                 "block": row.get("Block Size"), "metrics": {}})
        unit = row.get("Metric Unit") or ""
        key = row["Metric Name"] + (f" [{unit}]" if unit else "")
        kernel["metrics"][key] = _number(row["Metric Value"])
    return list(kernels.values())


def profile_case(ncu: str, case: str, workdir: Path) -> list[dict[str, Any]]:
    """Run one case under ncu; returns its kernels' metrics."""
    report = workdir / f"{case}.ncu-rep"
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--target-processes", "all",
           "--force-overwrite", "--export", str(report)]
    for section in SECTIONS:
        cmd += ["--section", section]
    cmd += ["--metrics", ",".join(METRICS), sys.executable, str(Path(__file__).resolve()), "--case", case]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ncu failed for {case} (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    details = subprocess.run([ncu, "--import", str(report), "--csv", "--page", "details", "--print-units", "base"],
                             capture_output=True, text=True, check=True).stdout
    return parse_details(details)


def summary(kernel: dict[str, Any]) -> dict[str, Any]:
    """The few figures that say what bounds a kernel, pulled out of its metrics (missing ones are None)."""
    m = kernel["metrics"]

    def pick(prefix: str) -> Any:
        return next((v for k, v in m.items() if k.startswith(prefix)), None)

    stalls = {k.split("issue_stalled_")[1].split("_per_issue")[0]: v for k, v in m.items()
              if "issue_stalled_" in k and isinstance(v, float)}
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:4]
    return {"kernel": kernel["kernel"][:60], "duration": pick("Duration"),
            "dram_read": pick("dram__bytes_read.sum"), "dram_write": pick("dram__bytes_write.sum"),
            "dram_pct": pick("DRAM Throughput"), "memory_pct": pick("Memory Throughput"),
            "compute_sm_pct": pick("Compute (SM) Throughput"), "l2_bytes": pick("lts__t_bytes.sum"),
            "registers": pick("Registers Per Thread"), "theoretical_occupancy": pick("Theoretical Occupancy"),
            "achieved_occupancy": pick("Achieved Occupancy"), "issue_active_pct": pick("Issue Slots Busy"),
            "warp_cycles_per_issue": pick("Warp Cycles Per Issued Instruction"), "top_stalls": top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default=None, help="child mode: run one case (under ncu)")
    parser.add_argument("--cases", nargs="*", default=CASES, help=f"cases to profile: {' '.join(CASES)}")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels/ncu_profile.py needs a CUDA device")
    if args.case is not None:
        run_case(args.case)
        return
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {CASES}")
    ncu = find_ncu()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "ncu": ncu, "sections": SECTIONS,
                              "metrics": METRICS, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            try:
                kernels = profile_case(ncu, case, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - keep the other cases
                result["cases"][case] = {"error": str(exc)}
                print(f"{case}: {exc}", flush=True)
                continue
            result["cases"][case] = [{**k, "summary": summary(k)} for k in kernels]
            for k in result["cases"][case]:
                print(case, json.dumps(k["summary"]), flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
