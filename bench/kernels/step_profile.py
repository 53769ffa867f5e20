"""Where a batch-1 decode step's GPU time goes: the step captured as one CUDA graph, its replays traced with the
torch profiler, and every kernel of one replay listed in launch order with its duration and the idle gap before
it, grouped by the layer kind it belongs to (the 30B-A3B step at batch 1 against its floor).

    python bench/kernels/step_profile.py --config bench/configs/nemotron-3-nano-30b-a3b.json --out step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_graph import capture  # noqa: E402

from hybridserve.common.model_config import ModelConfig  # noqa: E402
from hybridserve.engine.config import EngineConfig  # noqa: E402
from hybridserve.kernels import ops  # noqa: E402
from hybridserve.models.forward_batch import ForwardBatch  # noqa: E402
from hybridserve.models.weights import dummy_model  # noqa: E402
from hybridserve.statepool.state_cache import CacheLayout, StateCache  # noqa: E402

CONTEXT, PAGE = 512, 16


def decode_step(config: ModelConfig, batch: int, device: torch.device):  # noqa: ANN201 - (step fn, model, cache)
    """The model's forward of one new token per sequence + lm_head, each sequence CONTEXT tokens in."""
    model = dummy_model(config, torch.bfloat16, device)
    pages = CONTEXT // PAGE + 1
    layout = CacheLayout(num_pages=pages * batch, page_size=PAGE, num_slots=batch,
                         conv_width=config.mamba.conv_kernel - 1 if config.mamba else 3)
    cache = StateCache(config, layout, torch.bfloat16, torch.float32, device)
    tables = torch.arange(pages * batch, device=device).view(batch, pages)
    fb = ForwardBatch(num_decode=batch, query_lens=(1,) * batch, cu_seqlens=torch.arange(batch + 1, device=device),
                      context_lens=torch.full((batch,), CONTEXT, device=device),
                      kv_lens=torch.full((batch,), CONTEXT + 1, device=device),
                      state_slots=torch.arange(batch, device=device), block_tables=tables,
                      slot_mapping=tables[:, CONTEXT // PAGE] * PAGE + CONTEXT % PAGE)
    ids = torch.randint(0, config.vocab_size, (batch,), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))  # the same step in every run

    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, fb, cache))

    return step, model


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 200) -> float:
    """Median wall time of one replay, timed with CUDA events over `repeats` replays in groups of 10."""
    times = []
    for _ in range(repeats // 10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10)
    return statistics.median(times)


def traced_kernels(graph: torch.cuda.CUDAGraph, replays: int) -> list[list[dict[str, Any]]]:
    """Kernels of each traced replay in start order: name, ts and dur in us (from the profiler's chrome trace)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per = len(kernels) // replays
    return [[{"name": k["name"], "ts": k["ts"], "dur": k["dur"]} for k in kernels[i * per:(i + 1) * per]]
            for i in range(replays)]


def family(name: str) -> str:
    """A short kernel family name (Triton kernels are named by function; library kernels by their template)."""
    short = name.split("(")[0].split("<")[0].strip()
    for key in ("gemv", "gemm", "sm90_xmma", "cutlass", "nvjet", "splitKreduce"):
        if key in name:
            return "cublas:" + key
    return short[:60] or name[:60]


def analyse(replays: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per kernel position: median duration and median gap before it over replays; totals and families."""
    rows = []
    for pos in range(len(replays[0])):
        durs = [r[pos]["dur"] for r in replays]
        gaps = [r[pos]["ts"] - (r[pos - 1]["ts"] + r[pos - 1]["dur"]) for r in replays] if pos else [0.0]
        rows.append({"pos": pos, "kernel": family(replays[0][pos]["name"]),
                     "dur_us": statistics.median(durs), "gap_us": statistics.median(gaps)})
    families: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "dur_us": 0.0, "gap_us": 0.0})
    for row in rows:
        fam = families[row["kernel"]]
        fam["count"] += 1
        fam["dur_us"] += row["dur_us"]
        fam["gap_us"] += row["gap_us"]
    spans = [r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in replays]
    return {"kernels": len(rows), "span_us": statistics.median(spans),
            "busy_us": sum(r["dur_us"] for r in rows), "gaps_us": sum(r["gap_us"] for r in rows),
            "families": dict(sorted(families.items(), key=lambda kv: -kv[1]["dur_us"] - kv[1]["gap_us"])),
            "sequence": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--skinny-min-weight", type=int, default=None,
                        help="route projections of at least this many weight elements to the skinny kernel "
                             "(default: kernels.ops.SKINNY_MIN_WEIGHT)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--save-logits", type=Path, default=None,
                        help="save the first replay's logits (torch.save), to compare A/B trees' numerics")
    args = parser.parse_args()
    if args.skinny_min_weight is not None:  # an A/B of the dispatch threshold, this process only
        ops.SKINNY_MIN_WEIGHT = args.skinny_min_weight
    device = torch.device("cuda")
    # the engine's precision defaults (W8A8 fp8 experts; the checkpoint's state dtypes), as a served step runs
    config = EngineConfig(device="cpu").runtime_model_config(ModelConfig.from_hf_dict(json.loads(args.config.read_text())))
    step, _model = decode_step(config, args.batch, device)
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        graph = capture(lambda: outputs.append(step()))  # outputs[-1]: the captured call's logits buffer
        graph.replay()  # the step after one eager warm-up step, from the same dummy weights and cache
        if args.save_logits:
            torch.save(outputs[-1].float().cpu(), args.save_logits)
        wall = replay_ms(graph)
        result = {"device": torch.cuda.get_device_name(), "config": args.config.name, "batch": args.batch,
                  "context": CONTEXT, "graph_replay_ms": wall,
                  "skinny_min_weight": ops.SKINNY_MIN_WEIGHT, **analyse(traced_kernels(graph, args.replays))}
    print(f"{args.config.name} batch {args.batch} skinny>={ops.SKINNY_MIN_WEIGHT}: replay {wall:.3f} ms, "
          f"{result['kernels']} kernels, "
          f"busy {result['busy_us'] / 1e3:.3f} ms, gaps {result['gaps_us'] / 1e3:.3f} ms")
    for name, fam in list(result["families"].items())[:25]:
        print(f"  {fam['count']:4d}  {fam['dur_us']:9.1f} us  gaps {fam['gap_us']:7.1f} us  {name}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
