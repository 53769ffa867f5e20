"""Launch-shape sweep of the SSD scan on the GPU: the state walk's fixed tile choice (`WalkConfig`: heads per
program, BLOCK_P x BLOCK_N, warps) and the output kernel's autotune timings, at the kernel table's shapes.

    python bench/kernels/ssd_sweep.py [--out bench/results/<device>/kernels/ssd_sweep.json] [--quick]
    python bench/kernels/ssd_sweep.py --kernel-times [--out ...]   # per-kernel GPU time of a few walk tiles, whole sequences

The walk is not autotuned (in pool mode a rerun reads its own output), so `walk_config` encodes what this finds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_table import CONFIGS, STATE_BLOCK, ssd_inputs  # noqa: E402

from hybridserve.kernels.ssd_chunk_scan_triton import chunk_scan_kernel  # noqa: E402
from hybridserve.kernels.ssd_chunk_state_triton import WalkConfig  # noqa: E402
from hybridserve.kernels.ssd_scan_meta import WHOLE_SEQUENCE, chunk_metadata  # noqa: E402
from hybridserve.kernels.ssd_scan_triton import ssd_scan_varlen_triton  # noqa: E402


def walk_space(heads_per_group: int) -> list[WalkConfig]:
    """The state-walk tiles that led earlier, wider sweeps (16..128 stacked rows x 32..128 state columns)."""
    shapes = [(1, 32, 128, 4), (2, 16, 128, 4), (8, 16, 64, 8)]
    return [WalkConfig(block_p, block_n, warps, 2, heads=heads) for heads, block_p, block_n, warps in shapes
            if heads_per_group % heads == 0]


SEGMENTS = (8, 16, 32, WHOLE_SEQUENCE)  # chunks per walk segment (the last: one segment per sequence)


def kernel_times(fn: Callable[[], object], calls: int = 10) -> dict[str, float]:
    """Mean GPU time per call of each kernel fn launches, in us (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / calls, 1) for e in prof.key_averages()
            if e.device_time_total > 0 and "elementwise" not in e.key}


TILE_CHOICES = [None, WalkConfig(32, 128, 4, 2), WalkConfig(64, 128, 8, 2), WalkConfig(64, 128, 4, 2),
                WalkConfig(16, 128, 4, 2)]  # None: `walk_config`'s pick


def sweep_kernel_times() -> list[dict]:
    """Walk, join and output kernel times for a few walk tiles at every shape (one segment per sequence)."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (heads, head_dim, groups, state, chunk) in CONFIGS.items():
        for num_seqs, seqlen in ((1, 8192), (4, 2048), (1, 32768)):
            x, dt, A, B, C, D, bias, cu = ssd_inputs(heads, head_dim, groups, state, num_seqs, seqlen, gen)
            meta = chunk_metadata(cu, None, chunk, STATE_BLOCK, x.device)
            for walk in TILE_CHOICES:
                def run(walk=walk):
                    return ssd_scan_varlen_triton(x, dt, A, B, C, cu, chunk, D=D, dt_bias=bias,
                                                  state_block=STATE_BLOCK, meta=meta, walk=walk)
                row = {"config": name, "seqs": num_seqs, "seqlen": seqlen, "walk": str(walk), "us": kernel_times(run)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--kernel-times", action="store_true", help="per-kernel times of a few walk tiles only")
    args = parser.parse_args()
    if args.kernel_times:
        result = {"device": torch.cuda.get_device_name(), "kernel_times": sweep_kernel_times()}
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
        return
    rep = 40 if args.quick else 200
    rows: list[dict] = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (heads, head_dim, groups, state, chunk) in CONFIGS.items():
        for num_seqs, seqlen in ((1, 8192), (4, 2048), (1, 32768)):
            x, dt, A, B, C, D, bias, cu = ssd_inputs(heads, head_dim, groups, state, num_seqs, seqlen, gen)
            reference = None
            for walk, segment_chunks in itertools.product(walk_space(heads // groups), SEGMENTS):
                meta = chunk_metadata(cu, None, chunk, STATE_BLOCK, x.device, segment_chunks)
                def run(walk=walk, meta=meta):
                    return ssd_scan_varlen_triton(x, dt, A, B, C, cu, chunk, D=D, dt_bias=bias,
                                                  state_block=STATE_BLOCK, meta=meta, walk=walk)
                out = run()
                if reference is None:
                    reference = out.final_states.clone()
                err = float((out.final_states - reference).norm() / reference.norm())
                ms = float(do_bench(run, warmup=10, rep=rep, return_mode="median"))
                rows.append({"config": name, "seqs": num_seqs, "seqlen": seqlen, "walk": walk.__dict__,
                             "segment_chunks": segment_chunks, "ms": ms,
                             "final_rel_diff": err})
                print(f"{name} {num_seqs}x{seqlen} {walk} seg {segment_chunks} {ms:.3f} ms (diff {err:.1e})", flush=True)
    timings = {str(k): v for k, v in getattr(chunk_scan_kernel, "configs_timings", {}).items()} if hasattr(
        chunk_scan_kernel, "configs_timings") else {}
    result = {"device": torch.cuda.get_device_name(), "walk": rows, "output_kernel_last_autotune": timings}
    best: dict[str, dict] = {}
    for row in rows:
        key = f"{row['config']} {row['seqs']}x{row['seqlen']}"
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = row
    for key, row in best.items():
        print(f"best {key}: {row['walk']} seg {row['segment_chunks']} {row['ms']:.3f} ms")
    result["best"] = best
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
