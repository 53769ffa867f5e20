"""Kernel benchmarks on the GPU, side by side with mamba_ssm 2.3.2's Triton kernels and the machine's ceilings.
Decode-time kernels (state update, verify) are timed as CUDA-graph replays, as the decode step runs them.

    python bench/kernels/kernel_table.py [--out bench/results/<device>/kernels/kernels.json] [--quick]

Measures device copy bandwidth and bf16 matmul TFLOP/s, then the kernel table: SSD scan, single-token state
update, T=4 verify, the whole-model decode step (bench/kernels/decode_step.py) and the decode projections
(bench/kernels/skinny_linear.py). Every figure is the median of many
runs (triton.testing.do_bench) and is printed beside its floor (bytes / copy bandwidth or flops / matmul peak).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_graph import capture  # noqa: E402
from decode_step import bench_decode_step  # noqa: E402
from peer import load_peer  # noqa: E402
from sections import run_sections, write_json  # noqa: E402
from skinny_linear import bench_skinny_linear  # noqa: E402

from hybridserve.kernels.replay_state_update import ReplayCache, replay_state_update_triton  # noqa: E402
from hybridserve.kernels.ssd_scan_meta import chunk_metadata  # noqa: E402
from hybridserve.kernels.ssd_scan_triton import (  # noqa: E402
    OUTPUT_KERNELS,
    default_output_kernel,
    ssd_scan_varlen_triton,
)
from hybridserve.kernels.state_update_triton import (  # noqa: E402
    multi_token_state_update_triton,
    selective_state_update_triton,
)

CONFIGS = {  # heads, head_dim, groups, state, chunk
    "nemotron-nano-9b-v2": (128, 80, 8, 128, 128),
    "mamba2-2.7b": (80, 64, 1, 128, 256),
}
STATE_BLOCK = 1024  # kept chunk-end states every 1024 tokens (a multiple of both chunk sizes)


def median_ms(fn: Callable[[], Any], quick: bool) -> float:
    """Median time of fn in ms (CUDA events, warm-up first)."""
    return float(do_bench(fn, warmup=10 if quick else 50, rep=50 if quick else 300, return_mode="median"))


def graph_ms(fn: Callable[[], Any], quick: bool) -> float:
    """Median time of fn replayed as a CUDA graph (no Python launch overhead, as in the decode step)."""
    return median_ms(capture(fn).replay, quick)


def profile(fn: Callable[[], Any], label: str) -> str:
    """Per-kernel GPU time of one call of fn (torch.profiler), as a printed table."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
    print(f"--- profile: {label}\n{table}", flush=True)
    return table


def ceilings(quick: bool) -> dict[str, float]:
    """Device-to-device copy GB/s (read + write) and dense bf16 matmul TFLOP/s."""
    n = 1 << 28  # 1 GiB of fp32
    src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    copy_ms = median_ms(lambda: dst.copy_(src), quick)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b, quick)
    del src, dst
    return {"copy_GBps": 2 * n * 4 / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def ssd_inputs(heads: int, head_dim: int, groups: int, state: int, num_seqs: int, seqlen: int,
               gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random bf16 scan inputs for num_seqs sequences of seqlen tokens: x, dt, A, B, C, D, dt_bias, cu_seqlens."""
    tokens = num_seqs * seqlen

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    x, dt = r(tokens, heads, head_dim), r(tokens, heads, scale=0.5)
    B, C = r(tokens, groups, state), r(tokens, groups, state)
    A = -torch.rand(heads, device="cuda", generator=gen) * 4 - 0.5
    D, bias = torch.randn(heads, device="cuda"), torch.randn(heads, device="cuda") * 0.5
    return x, dt, A, B, C, D, bias, torch.arange(0, tokens + 1, seqlen, device="cuda")


def bench_ssd(peer: dict | None, ceil: dict, quick: bool) -> list[dict]:
    """Tokens/s per layer of our varlen scan (with kept states) vs mamba_chunk_scan_combined."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (heads, head_dim, groups, state, chunk) in CONFIGS.items():
        for num_seqs, seqlen in ((1, 8192), (4, 2048), (1, 32768)):
            tokens = num_seqs * seqlen
            x, dt, A, B, C, D, bias, cu = ssd_inputs(heads, head_dim, groups, state, num_seqs, seqlen, gen)
            meta = chunk_metadata(cu, None, chunk, STATE_BLOCK, x.device)

            def ours(output_kernel: str | None = None):
                return ssd_scan_varlen_triton(x, dt, A, B, C, cu, chunk, D=D, dt_bias=bias, state_block=STATE_BLOCK,
                                              meta=meta, output_kernel=output_kernel)

            ours_ms = median_ms(ours, quick)
            ours_graph_ms = graph_ms(ours, quick)  # GPU time alone: no Python launch overhead
            other = next(k for k in OUTPUT_KERNELS if k != default_output_kernel(chunk))
            other_ms = median_ms(lambda: ours(other), quick)
            io_bytes = tokens * (2 * heads * head_dim * 2 + 2 * groups * state * 2 + heads * 2)
            io_bytes += (tokens // STATE_BLOCK + num_seqs) * heads * head_dim * state * 4
            flops = tokens * heads * (4 * head_dim * state + 2 * chunk * head_dim + 2 * chunk * state // (heads // groups))
            floor_ms = max(io_bytes / ceil["copy_GBps"] / 1e6, flops / ceil["bf16_matmul_TFLOPs"] / 1e9)
            row = {"config": name, "seqs": num_seqs, "seqlen": seqlen, "ours_ms": ours_ms, "ours_graph_ms": ours_graph_ms,
                   "ours_Mtok_s": tokens / ours_ms / 1e3, "floor_ms": floor_ms,
                   "output_kernel": default_output_kernel(chunk), f"with_{other}_output_ms": other_ms}
            if peer is not None:
                xb, dtb, Bb, Cb = (t.view(num_seqs, seqlen, *t.shape[1:]) for t in (x, dt, B, C))

                def theirs():
                    return peer["mamba_chunk_scan_combined"](xb, dtb, A, Bb, Cb, chunk, D=D, dt_bias=bias,
                                                             dt_softplus=True, return_final_states=True)

                peer_runs = sorted(median_ms(theirs, quick) for _ in range(3))  # the median of three timings
                peer_ms = peer_runs[1]
                y_peer, final_peer = theirs()
                out = ours()
                err = float((out.y.float() - y_peer.reshape(out.y.shape).float()).norm() / y_peer.float().norm())
                peer_graph_ms = graph_ms(theirs, quick)
                row.update(peer_ms=peer_ms, peer_ms_runs=peer_runs, peer_Mtok_s=tokens / peer_ms / 1e3, speedup=peer_ms / ours_ms,
                           peer_graph_ms=peer_graph_ms, speedup_graph=peer_graph_ms / ours_graph_ms, y_rel_diff_vs_peer=err)
            if num_seqs == 1 and seqlen == 8192:
                row["profile_ours"] = profile(ours, f"ours {name} 1x8192")
                if peer is not None:
                    row["profile_peer"] = profile(theirs, f"mamba_ssm {name} 1x8192")
            rows.append(row)
            print(f"ssd {name:20s} {num_seqs}x{seqlen:<6d} ours {row['ours_Mtok_s']:7.2f} Mtok/s "
                  f"({ours_ms:.3f} ms, floor {floor_ms:.3f} ms)"
                  + (f"  peer {row['peer_Mtok_s']:6.2f} Mtok/s  x{row['speedup']:.2f}; as CUDA graphs "
                     f"{ours_graph_ms:.3f} vs {row['peer_graph_ms']:.3f} ms x{row['speedup_graph']:.2f}"
                     if "peer_ms" in row else ""),
                  flush=True)
            del x, dt, B, C
    return rows


def _ssu_inputs(batch: int, tokens: int, state_dtype: torch.dtype, gen: torch.Generator) -> dict:
    heads, head_dim, groups, state, _ = CONFIGS["nemotron-nano-9b-v2"]
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    return dict(
        pool=torch.randn(batch, heads, head_dim, state, device="cuda", generator=gen).to(state_dtype),
        slots=torch.randperm(batch, device="cuda", generator=gen),
        x=r(batch, tokens, heads, head_dim), dt=r(batch, tokens, heads, scale=0.5), z=r(batch, tokens, heads, head_dim),
        B=r(batch, tokens, groups, state), C=r(batch, tokens, groups, state),
        A=-torch.rand(heads, device="cuda", generator=gen) - 0.5, D=torch.randn(heads, device="cuda"),
        bias=torch.randn(heads, device="cuda") * 0.5,
    )


def _peer_step(peer: dict, t: dict, tok: int) -> Callable[[], Any]:
    """mamba_ssm's selective_state_update on token `tok` (its broadcast [H, P, N] A / [B, H, P] dt layout)."""
    heads, head_dim, _, state, _ = CONFIGS["nemotron-nano-9b-v2"]
    A = t["A"][:, None, None].expand(heads, head_dim, state)
    dt = t["dt"][:, tok, :, None].expand(-1, -1, head_dim)
    bias, D = t["bias"][:, None].expand(heads, head_dim), t["D"][:, None].expand(heads, head_dim)
    x, z, B, C = t["x"][:, tok], t["z"][:, tok], t["B"][:, tok], t["C"][:, tok]
    return lambda: peer["selective_state_update"](t["pool"], x, dt, A, B, C, D=D, z=z, dt_bias=bias,
                                                  dt_softplus=True, state_batch_indices=t["slots"])


def bench_state_update(peer: dict | None, ceil: dict, quick: bool) -> list[dict]:
    """Single-token decode update: achieved state GB/s (read + write) vs copy bandwidth."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for state_dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 8, 32, 128, 256):
            t = _ssu_inputs(batch, 1, state_dtype, gen)
            state_bytes = 2 * t["pool"].numel() * t["pool"].element_size()
            ms = graph_ms(lambda: selective_state_update_triton(
                t["pool"], t["slots"], t["x"][:, 0], t["dt"][:, 0], t["A"], t["B"][:, 0], t["C"][:, 0], D=t["D"],
                dt_bias=t["bias"], z=t["z"][:, 0]), quick)
            row = {"state_dtype": str(state_dtype).replace("torch.", ""), "batch": batch, "ours_us": ms * 1e3,
                   "state_GBps": state_bytes / ms / 1e6, "pct_of_copy": 100 * state_bytes / ms / 1e6 / ceil["copy_GBps"],
                   "floor_us": state_bytes / ceil["copy_GBps"] / 1e3}
            if peer is not None:
                peer_ms = graph_ms(_peer_step(peer, t, 0), quick)
                row.update(peer_us=peer_ms * 1e3, peer_GBps=state_bytes / peer_ms / 1e6)
            rows.append(row)
            print(f"ssu {row['state_dtype']:8s} b={batch:<4d} ours {row['ours_us']:8.1f} us "
                  f"{row['state_GBps']:7.0f} GB/s ({row['pct_of_copy']:.0f}% of copy, floor {row['floor_us']:.1f} us)"
                  + (f"  peer {row['peer_us']:8.1f} us {row['peer_GBps']:7.0f} GB/s" if peer else ""), flush=True)
            del t
    return rows


def sweep_state_update(ceil: dict, quick: bool) -> list[dict]:
    """Launch-shape sweep of the decode update (picks the defaults; not part of the issue table)."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    for state_dtype, batch in ((torch.float32, 32), (torch.float32, 128), (torch.bfloat16, 128), (torch.bfloat16, 32),
                               (torch.bfloat16, 8), (torch.float32, 1)):
        t = _ssu_inputs(batch, 1, state_dtype, gen)
        state_bytes = 2 * t["pool"].numel() * t["pool"].element_size()
        for block_p in (8, 16, 32):
            for warps in (1, 2, 4):
                for tiles in (1, 2, 5):
                    if block_p * tiles > 128:
                        continue
                    ms = graph_ms(lambda: multi_token_state_update_triton(
                        t["pool"], t["slots"], t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], dt_bias=t["bias"],
                        z=t["z"], block_p=block_p, num_warps=warps, tiles=tiles), quick)
                    rows.append({"state_dtype": str(state_dtype), "batch": batch, "block_p": block_p, "warps": warps,
                                 "tiles": tiles, "us": ms * 1e3,
                                 "pct_of_copy": 100 * state_bytes / ms / 1e6 / ceil["copy_GBps"]})
        del t
    for r in rows:
        print(f"ssu sweep {r['state_dtype'][6:]} b{r['batch']} p{r['block_p']} w{r['warps']} t{r['tiles']} "
              f"{r['us']:.1f} us {r['pct_of_copy']:.0f}%")
    return rows


def bench_verify(peer: dict | None, ceil: dict, quick: bool, tokens: int = 4) -> list[dict]:
    """T-token verify: intermediate method vs replay (when built) vs T single-token calls of mamba_ssm."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    for batch in (1, 8, 32, 128, 256):
        t = _ssu_inputs(batch, tokens, torch.float32, gen)
        one_state = t["pool"][0].numel() * 4
        inter = torch.empty(batch, tokens, *t["pool"].shape[1:], device="cuda", dtype=torch.float32)
        ms = graph_ms(lambda: multi_token_state_update_triton(
            t["pool"], t["slots"], t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], dt_bias=t["bias"], z=t["z"],
            intermediate_states=inter, write_final_state=False), quick)
        row = {"batch": batch, "T": tokens, "intermediate_us": ms * 1e3,
               "intermediate_state_bytes_per_seq": (1 + tokens) * one_state,
               "intermediate_floor_us": batch * (1 + tokens) * one_state / ceil["copy_GBps"] / 1e3}
        heads, head_dim, groups, state, _ = CONFIGS["nemotron-nano-9b-v2"]
        cache = ReplayCache.allocate(batch, tokens, heads, head_dim, groups, state, torch.bfloat16, "cuda")
        accepted = torch.full((batch,), 2, dtype=torch.int32, device="cuda")  # replay 2 of the last 4 tokens
        ms = graph_ms(lambda: replay_state_update_triton(
            t["pool"], cache, t["slots"], accepted, t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"],
            dt_bias=t["bias"], z=t["z"]), quick)
        if batch == 128:  # launch-shape sweep of the replay main kernel (picks its defaults)
            sweep = {}
            for block_p in (16, 32):
                for warps in (1, 2):
                    for dot in (True, False):
                        sweep[f"p{block_p}_w{warps}_{'dot' if dot else 'reduce'}"] = 1e3 * graph_ms(
                            lambda: replay_state_update_triton(
                                t["pool"], cache, t["slots"], accepted, t["x"], t["dt"], t["A"], t["B"], t["C"],
                                D=t["D"], dt_bias=t["bias"], z=t["z"], block_p=block_p, num_warps=warps,
                                dot_outputs=dot), quick)
            row["replay_sweep_us"] = sweep
        row.update(replay_us=ms * 1e3, replay_state_bytes_per_seq=2 * one_state,
                   replay_floor_us=batch * 2 * one_state / ceil["copy_GBps"] / 1e3,
                   replay_speedup_vs_intermediate=row["intermediate_us"] / (ms * 1e3))
        if peer is not None:
            steps = [_peer_step(peer, t, k) for k in range(tokens)]
            row["peer_T_calls_us"] = graph_ms(lambda: [s() for s in steps], quick) * 1e3
            row["peer_state_bytes_per_seq"] = 2 * tokens * one_state
        rows.append(row)
        print("verify " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        del t, inter
    return rows


def _attention(ceil: dict, quick: bool) -> list[dict]:
    """Paged attention vs SDPA / flex attention (bench/kernels/attention.py)."""
    from attention import bench_attention

    return bench_attention(ceil, median_ms, quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="sections to skip: ssd ssu ssu_sweep verify decode linear attention")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels/kernel_table.py needs a CUDA device")
    device = torch.cuda.get_device_name()
    result: dict[str, Any] = {"device": device, "torch": torch.__version__, "triton": triton.__version__}
    try:
        peer = load_peer()
        result["peer"] = "mamba_ssm 2.3.2.post1 (Triton ops from the sdist)"
    except Exception as exc:  # noqa: BLE001 - the bench still runs our side
        peer, result["peer"] = None, f"unavailable: {exc!r}"
    result["ceilings"] = ceil = ceilings(args.quick)
    print(f"{device}: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
          flush=True)
    sections = {"ssd": lambda: bench_ssd(peer, ceil, args.quick),
                "ssu": lambda: bench_state_update(peer, ceil, args.quick),
                "ssu_sweep": lambda: sweep_state_update(ceil, args.quick),
                "verify": lambda: bench_verify(peer, ceil, args.quick),
                "decode": lambda: bench_decode_step(ceil, median_ms, args.quick),
                "linear": lambda: bench_skinny_linear(ceil, args.quick),
                "attention": lambda: _attention(ceil, args.quick)}
    run_sections(sections, args.skip, result)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
