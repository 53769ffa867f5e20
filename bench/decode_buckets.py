"""Decode steps at every batch size 1-8 replayed from the exact-size graph vs the padded power-of-two bucket.

    python bench/decode_buckets.py --batches 1 2 3 4 5 6 7 8 --context 1024 --steps 40 --out FILE

One engine (the serving benchmark's settings) holds B decoding requests; each round times `--steps` decode steps
replayed from a second set of graphs captured for every batch size up to 8 ("exact"), then the same with the
engine's own buckets (powers of two: a batch of 5 replays the 8-row graph, "padded"), alternating, so the
padding's cost is measured on one GPU in one process. Medians of the per-step wall times over all rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from one_batch import add_engine_flags, dummy_model_dir, engine_config, random_prompts, sync
from sections import write_json

from hybridserve.engine.cuda_graphs import DecodeGraphs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.sampling_params import SamplingParams


def step_ms(engine: LLMEngine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        sync(engine)
        start = time.perf_counter()
        engine.step()
        sync(engine)
        times.append(1e3 * (time.perf_counter() - start))
    return times


def start_decoding(engine: LLMEngine, batch: int, context: int) -> list[str]:
    """Add `batch` endless requests of `context` random prompt tokens and step until all of them decode; their ids."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=10**6, ignore_eos=True))
           for p in random_prompts(batch, context, batch, engine.model_config.vocab_size)]
    while engine.scheduler.waiting or any(not r.is_decoding for r in engine.scheduler.running):
        engine.step()
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else dummy_model_dir(args.dummy_config)
    engine = LLMEngine(model_dir, engine_config(args, enable_prefix_caching=False))
    graphed = engine.runner.model
    padded = getattr(graphed, "graphs", None)
    if padded is None:
        raise SystemExit("decode graphs are off (CPU?): nothing to compare")
    exact = DecodeGraphs(graphed.model, engine.cache, engine.max_running, -(-engine.max_model_len // engine.config.page_size),
                         buckets=tuple(range(1, 9)))
    exact.capture()
    rows = []
    for batch in args.batches:
        ids = start_decoding(engine, batch, args.context)
        times: dict[str, list[float]] = {"exact": [], "padded": []}
        for _ in range(args.rounds):
            for name, graphs in (("exact", exact), ("padded", padded)):
                graphed.graphs = graphs
                times[name] += step_ms(engine, args.steps)
        graphed.graphs = padded
        for rid in ids:
            engine.abort(rid)
        engine.step()
        row = {"batch": batch, "bucket_padded": next(b for b in padded.buckets if b >= batch),
               **{f"step_ms_{k}": round(statistics.median(v), 3) for k, v in times.items()}}
        rows.append(row)
        print(row, flush=True)
    write_json({"device": torch.cuda.get_device_name(), "context": args.context, "buckets": list(padded.buckets),
                "rows": rows},
               Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
