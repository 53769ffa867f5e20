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

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.cuda_graphs import DecodeGraphs
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


def start_decoding(engine: LLMEngine, batch: int, context: int) -> list[str]:
    """Add `batch` endless requests of `context` random prompt tokens and step until all of them decode; their ids."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=10**6, ignore_eos=True))
           for p in random_prompts(batch, context, batch, engine.model_config.vocab_size)]
    while engine.scheduler.waiting or any(not r.is_decoding for r in engine.scheduler.running):
        engine.step()
    return ids


def graph_ab_engine(description: str, batches: list[int]) -> tuple[argparse.Namespace, LLMEngine]:
    """The flags of a benchmark that times decode steps with two sets of graphs (--batches, --context, --steps,
    --rounds, --out and the engine's), parsed, and its engine (the serving settings, prefix caching off)."""
    parser = argparse.ArgumentParser(description=description)
    add_engine_flags(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=batches)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else dummy_model_dir(args.dummy_config)
    return args, LLMEngine(model_dir, engine_config(args, enable_prefix_caching=False))


def main() -> None:
    args, engine = graph_ab_engine(__doc__.split("\n")[0], [1, 2, 3, 4, 5, 6, 7, 8])
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
                times[name] += timed_steps(engine, args.steps)[0]
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
