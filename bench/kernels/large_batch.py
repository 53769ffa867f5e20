"""The decode step's two largest kernels at production batch (256-1,024 rows), per launch shape, beside their
bytes floors: the routed fp8 experts' grouped GEMMs (Nemotron-3-Nano-30B-A3B shapes) by rows per aligned block,
and the single-token SSM state update (Nano-9B-v2 and 30B-A3B shapes) by tile, in the state pool's own
request-major layout (a per-layer strided view of [slots, layers, H, P, N]).

    python bench/kernels/large_batch.py --out bench/results/<device>/decode_step/large_batch.json [--quick]

Floors: bytes / the copy bandwidth measured in the same run (read + write); the MoE row also gives its flops at
the bf16 matmul peak measured in the run (weight-only: the grouped GEMM multiplies in bf16 after an exact fp8
upcast; W8A8 rows, `fp8_activations`: fp8 x fp8 after a per-row quantization of each GEMM's input). Each
figure is triton's do_bench median of CUDA-graph replays with L2 flushed between them.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_table import ceilings, graph_ms  # noqa: E402
from sections import run_sections, write_json  # noqa: E402

from hybridserve.kernels.moe import quantize_fp8_rows  # noqa: E402
from hybridserve.kernels.moe_triton import choose_block_m, moe_experts_triton  # noqa: E402
from hybridserve.kernels.state_update_triton import multi_token_state_update_triton  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHAPES = {"nano-9b-v2": "nemotron-nano-9b-v2.json", "30b-a3b": "nemotron-3-nano-30b-a3b.json"}
BATCHES = (256, 768, 1024)  # state update rows
BLOCK_M = (16, 32, 64, 128)  # rows per aligned block
MOE_TOKENS = (256, 384, 512, 640, 768, 1024)  # 12-48 pairs per expert at top 6 of 128: where the default changes
POOL_BUDGET = 64e9  # bytes of state pool per case; fewer layers in the pool when all of them do not fit


def graph_us(fn: Any, quick: bool) -> float:
    """`graph_ms` in us."""
    return graph_ms(fn, quick) * 1e3


@functools.cache
def _config(name: str) -> dict[str, Any]:
    """The shape's config.json from bench/configs."""
    return json.loads((CONFIGS / SHAPES[name]).read_text())


def bench_moe(ceil: dict[str, float], quick: bool, tokens: tuple[int, ...] = MOE_TOKENS) -> list[dict[str, Any]]:
    """Routed fp8 experts (up relu2 + down + combine, no shared expert) at N tokens x top-k, uniform routing."""
    cfg = _config("30b-a3b")
    d, inter, experts, top_k = (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"],
                                cfg["num_experts_per_tok"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_up, up_scale = quantize_fp8_rows(torch.randn(experts, inter, d, device="cuda", generator=gen) * 0.02)
    w_down, down_scale = quantize_fp8_rows(torch.randn(experts, d, inter, device="cuda", generator=gen) * 0.02)
    weight_bytes = 2 * experts * inter * d  # fp8: up + down, every expert touched at these batches
    rows = []
    for n in tokens:
        x = torch.randn(n, d, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(n, experts, device="cuda", generator=gen).topk(top_k, dim=-1)[1]
        weights = torch.rand(n, top_k, device="cuda", generator=gen)
        pairs = n * top_k
        # x read + out written; hidden and pair rows written + read
        act_bytes = 2 * (n * d * 2 + pairs * inter * 2 + pairs * d * 2)
        floor_us = (weight_bytes + act_bytes) / ceil["copy_GBps"] / 1e3
        flops_us = 2 * 2 * pairs * inter * d / ceil["bf16_matmul_TFLOPs"] / 1e6
        for a8 in (False, True):  # weight-only fp8 (bf16 activations), then W8A8 (rows quantized per GEMM)
            for block_m in BLOCK_M:
                us = graph_us(lambda bm=block_m, a8=a8: moe_experts_triton(
                    x, w_up, w_down, weights, ids, up_scale, down_scale, block_m=bm, fp8_activations=a8), quick)
                row = {"tokens": n, "pairs": pairs, "block_m": block_m, "fp8_activations": a8,
                       "default": block_m == choose_block_m(pairs, experts), "us": us, "bytes_floor_us": floor_us,
                       "flops_floor_us": flops_us, "over_floor": us / floor_us}
                rows.append(row)
                print(f"moe fp8{' a8' if a8 else '   '} n={n:<5d} block_m={block_m:<4d}{'*' if row['default'] else ' '} "
                      f"{us:8.1f} us  floor {floor_us:6.1f} us ({us / floor_us:.2f}x)  flops floor {flops_us:6.1f} us",
                      flush=True)
    return rows


def _state_case(name: str, batch: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, Any]:
    """A request-major pool of `batch` slots (as many layers as POOL_BUDGET holds), one layer's view, random inputs."""
    cfg = _config(name)
    heads, head_dim, groups, state = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"], cfg["ssm_state_size"]
    layers = cfg["hybrid_override_pattern"].count("M")
    per_layer = heads * head_dim * state * torch.tensor([], dtype=dtype).element_size()
    layers = max(1, min(layers, int(POOL_BUDGET // (per_layer * batch))))
    pool = torch.empty(batch, layers, heads, head_dim, state, dtype=dtype, device="cuda").normal_(generator=gen)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    return dict(pool=pool[:, layers // 2], layers=layers, slots=torch.randperm(batch, device="cuda", generator=gen),
                x=r(batch, 1, heads, head_dim), z=r(batch, 1, heads, head_dim), dt=r(batch, 1, heads, scale=0.5),
                B=r(batch, 1, groups, state), C=r(batch, 1, groups, state),
                A=-torch.rand(heads, device="cuda", generator=gen) - 0.5, D=torch.randn(heads, device="cuda", generator=gen),
                bias=torch.randn(heads, device="cuda", generator=gen) * 0.5, state_bytes=2 * batch * per_layer)


def _update(t: dict[str, Any], block_p: int | None, warps: int | None) -> Callable[[], torch.Tensor]:
    """One single-token update of the case's layer at this launch shape (None: the launcher's default)."""
    return lambda: multi_token_state_update_triton(t["pool"], t["slots"], t["x"], t["dt"], t["A"], t["B"], t["C"],
                                                   D=t["D"], dt_bias=t["bias"], z=t["z"], block_p=block_p,
                                                   num_warps=warps)


def bench_state_update(ceil: dict[str, float], quick: bool) -> list[dict[str, Any]]:
    """Single-token update of one layer: the default launch and a sweep of (rows per tile, warps)."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(64, 2)] if quick else [(8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (64, 4), (64, 8)]
    for name in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for batch in BATCHES:
                t = _state_case(name, batch, dtype, gen)
                floor_us = t["state_bytes"] / ceil["copy_GBps"] / 1e3
                for block_p, warps in [(None, None), *shapes]:
                    us = graph_us(_update(t, block_p, warps), quick)
                    row = {"shape": name, "state_dtype": str(dtype).replace("torch.", ""), "batch": batch,
                           "pool_layers": t["layers"], "block_p": block_p or "default", "warps": warps or "default",
                           "us": us, "floor_us": floor_us, "over_floor": us / floor_us}
                    rows.append(row)
                    print(f"ssu {name} {row['state_dtype']:8s} b={batch:<5d} p={row['block_p']!s:8s} "
                          f"w={row['warps']!s:8s} {us:8.1f} us  floor {floor_us:7.1f} us ({us / floor_us:.2f}x)",
                          flush=True)
                del t
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    """Ceilings, then each section; the JSON is rewritten after each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="shorter timing loops; the state update's default launch and one other")
    parser.add_argument("--skip", nargs="*", default=[], choices=["moe", "state_update"])
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=list(MOE_TOKENS),
                        help="token counts of the MoE section (default: 256 .. 1,024)")
    args = parser.parse_args()
    ceil = ceilings(args.quick)
    print(f"copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "ceilings": ceil}
    sections = {"state_update": lambda: bench_state_update(ceil, args.quick),
                "moe": lambda: bench_moe(ceil, args.quick, tuple(args.moe_tokens))}
    for name, section in sections.items():  # the JSON is written after each (the MoE section spends most on tuning)
        run_sections({name: section}, args.skip, result)
        write_json(result, args.out)


if __name__ == "__main__":
    main()
