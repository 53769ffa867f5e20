"""A block's input left pending (`kernels/pending_norm.py`) against the add_rmsnorm launch it replaces, at
Nemotron-3-Nano-30B-A3B shapes (dummy weights) on the GPU, decode batch 1 (and 4 for the projections).

Per consumer, LAYER_COPIES distinct copies back to back in one CUDA graph (as a model's layers run, so
programmatic dependent launch overlaps them as in a step), time per copy (bench/moe.py's Timer: do_bench median
of graph replays, L2 flushed between replays):
  projections (Mamba in_proj, attention q/k/v): `unfused` = add_rmsnorm + the skinny projection,
  `pending` = the skinny projection normalising its input, `bare` = the projection of a ready input;
  MoE layer: `unfused` = add_rmsnorm + the layer, `pending` with the early shared programs (default) and
  without them, `bare` = the layer on a ready input.
Floor = the weight bytes over the copy bandwidth measured in the same run.

  source .whl/setup.sh && python bench/prenorm.py --out $OUT/prenorm.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe import CONFIG, Timer, ceilings, moe_layer  # noqa: E402

from hybridserve.kernels import ops  # noqa: E402
from hybridserve.kernels.pending_norm import PendingNorm  # noqa: E402
from hybridserve.models.config import ModelConfig  # noqa: E402

LAYER_COPIES = 4
PROJECTIONS = {"mamba in_proj": (10304, 2688), "attention q/k/v": (4608, 2688)}


def _inputs(rows: int, dim: int, copies: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """(block output, residual, norm weight) per copy."""
    return [(torch.randn(rows, dim, device="cuda", generator=gen).bfloat16(),
             torch.randn(rows, dim, device="cuda", generator=gen).bfloat16() * 4,
             (1 + 0.1 * torch.randn(dim, device="cuda", generator=gen)).bfloat16()) for _ in range(copies)]


def _variants(consumer: Callable[[Any, int], Any], inputs: list[tuple[torch.Tensor, ...]]) -> dict[str, Callable]:
    """The three ways to feed `consumer(input, copy)` from (out, residual, weight) per copy."""
    ready = [ops.add_rmsnorm(o, r, w, 1e-5)[0] for o, r, w in inputs]

    def unfused() -> None:
        for i, (o, r, w) in enumerate(inputs):
            consumer(ops.add_rmsnorm(o, r, w, 1e-5)[0], i)

    def pending() -> None:
        for i, (o, r, w) in enumerate(inputs):
            consumer(PendingNorm.after(o, r, w, 1e-5), i)

    def bare() -> None:
        for i, x in enumerate(ready):
            consumer(x, i)

    return {"unfused": unfused, "pending": pending, "bare": bare}


def bench_projections(timer: Timer, copy_gbps: float) -> list[dict]:
    rows_out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (out_features, in_features) in PROJECTIONS.items():
        weights = [(torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02).bfloat16()
                   for _ in range(LAYER_COPIES)]
        floor_us = out_features * in_features * 2 / copy_gbps / 1e3
        for rows in (1, 4):
            inputs = _inputs(rows, in_features, LAYER_COPIES, gen)
            row: dict[str, Any] = {"consumer": name, "rows": rows, "floor_us": floor_us}
            for variant, fn in _variants(lambda x, i: ops.linear(x, weights[i]), inputs).items():
                row[f"{variant}_us"] = timer(fn) * 1e3 / LAYER_COPIES
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    return rows_out


def bench_moe(timer: Timer, copy_gbps: float) -> list[dict]:
    config = ModelConfig.from_hf_dict(json.loads(CONFIG.read_text()))
    layers = [moe_layer(config, torch.device("cuda"), fp8=False, seed=i) for i in range(LAYER_COPIES)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = _inputs(1, config.hidden_size, LAYER_COPIES, gen)
    experts = layers[0].experts
    per_expert = (experts.up_proj[0].numel() + experts.down_proj[0].numel()) * 2
    dense = sum(t.numel() * 2 for t in layers[0].parameters()) - (experts.up_proj.numel() + experts.down_proj.numel()) * 2
    floor_us = (config.moe.experts_per_token * per_expert + dense) / copy_gbps / 1e3  # type: ignore[union-attr]
    row: dict[str, Any] = {"consumer": "moe layer", "rows": 1, "floor_us": floor_us}
    for early in ("1", "0"):
        os.environ["HYBRIDSERVE_MOE_EARLY_SHARED"] = early
        for variant, fn in _variants(lambda x, i: layers[i](x), inputs).items():
            if early == "1" or variant != "bare":
                row[f"{variant}{'' if early == '1' else '_no_early'}_us"] = timer(fn) * 1e3 / LAYER_COPIES
    os.environ.pop("HYBRIDSERVE_MOE_EARLY_SHARED")
    print(json.dumps(row), flush=True)
    return [row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip", nargs="*", default=[], choices=["projections", "moe"])
    args = parser.parse_args()
    timer = Timer(torch.device("cuda"), args.quick)
    ceil = ceilings(torch.device("cuda"), timer, big=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "ceilings": ceil}
    with torch.no_grad():
        if "projections" not in args.skip:
            result["projections"] = bench_projections(timer, ceil["copy_GBps"])
        if "moe" not in args.skip:
            result["moe"] = bench_moe(timer, ceil["copy_GBps"])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
