"""Decode steps replayed from graphs launched in pieces (HYBRIDSERVE_STAGED_GRAPHS=1) vs one graph per step.

    python bench/staged_graphs.py --batches 1 4 8 --context 1024 --steps 40 --rounds 3 --out FILE

One engine (the serving benchmark's settings) holds B decoding requests; each round times `--steps` engine steps
(host work, launch, GPU, sampling: what a served step costs) with decode graphs launched in pieces
(engine/cuda_graphs.py stage_cuts: the GPU starts the first piece while the host launches the rest) and with graphs
captured as one per step, alternating, on one GPU in one process. Medians of the per-step wall times over all rounds,
and the launch phase of each (`LLMEngine.last_step`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from decode_buckets import start_decoding
from one_batch import add_engine_flags, dummy_model_dir, engine_config, sync
from sections import write_json

from hybridserve.engine.cuda_graphs import DecodeGraphs, stage_cuts
from hybridserve.engine.llm_engine import LLMEngine


def timed_steps(engine: LLMEngine, steps: int) -> tuple[list[float], list[float]]:
    """Wall ms of `steps` engine steps, each from a synced GPU, and each step's launch phase in ms."""
    walls, launches = [], []
    for _ in range(steps):
        sync(engine)
        start = time.perf_counter()
        engine.step()
        sync(engine)
        walls.append(1e3 * (time.perf_counter() - start))
        launches.append(1e3 * engine.last_step.launch)
    return walls, launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else dummy_model_dir(args.dummy_config)
    engine = LLMEngine(model_dir, engine_config(args, enable_prefix_caching=False))
    graphed = engine.runner.model
    if getattr(graphed, "graphs", None) is None:
        raise SystemExit("decode graphs are off (CPU?): nothing to compare")
    buckets = tuple(b for b in graphed.graphs.buckets if b <= max(args.batches))
    sets = {name: DecodeGraphs(graphed.model, engine.cache, engine.max_running,
                               -(-engine.max_model_len // engine.config.page_size), buckets=buckets, stages=stages)
            for name, stages in (("staged", stage_cuts(len(graphed.model.layers))), ("whole", ()))}
    for graphs in sets.values():
        graphs.capture()
    rows = []
    for batch in args.batches:
        ids = start_decoding(engine, batch, args.context)
        times: dict[str, list[float]] = {"staged": [], "whole": []}
        launch: dict[str, list[float]] = {"staged": [], "whole": []}
        for _ in range(args.rounds):
            for name, graphs in sets.items():
                graphed.graphs = graphs
                walls, launches = timed_steps(engine, args.steps)
                times[name] += walls
                launch[name] += launches
        for rid in ids:
            engine.abort(rid)
        engine.step()
        row = {"batch": batch, **{f"step_ms_{k}": round(statistics.median(v), 3) for k, v in times.items()},
               **{f"launch_ms_{k}": round(statistics.median(v), 3) for k, v in launch.items()}}
        row["staged_over_whole"] = round(row["step_ms_staged"] / row["step_ms_whole"], 4)
        rows.append(row)
        print(row, flush=True)
    write_json({"device": torch.cuda.get_device_name(), "context": args.context, "stages": list(sets["staged"].stages),
                "layers": len(graphed.model.layers), "rows": rows}, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
