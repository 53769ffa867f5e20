"""Decode steps replayed from graphs launched in pieces (HYBRIDSERVE_STAGED_GRAPHS=1) vs one graph per step.

    python bench/staged_graphs.py --batches 1 4 8 --context 1024 --steps 40 --rounds 3 --out FILE

One engine (the serving benchmark's settings) holds B decoding requests; each round times `--steps` engine steps
(host work, launch, GPU, sampling: what a served step costs) with decode graphs launched in pieces
(engine/cuda_graphs.py stage_cuts: the GPU starts the first piece while the host launches the rest) and with graphs
captured as one per step, alternating, on one GPU in one process. Medians of the per-step wall times over all rounds,
and the launch phase of each (`LLMEngine.last_step`).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from decode_buckets import graph_ab_engine, start_decoding, timed_steps
from sections import write_json

from hybridserve.engine.cuda_graphs import DecodeGraphs, stage_cuts


def main() -> None:
    args, engine = graph_ab_engine(__doc__.split("\n")[0], [1, 4, 8])
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
