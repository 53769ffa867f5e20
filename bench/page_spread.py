"""Does where a request's KV pages lie change the decode step? Packed (lowest free pages first) against spread
(the free list shuffled over the whole pool), with the prefix cache off and on, in one process.

    python bench/page_spread.py --batches 1,5,8 --input-len 1024 --output-len 64 --rounds 4 --json OUT

A cache-off pool hands a finished request's pages to the next one (a LIFO free list: the same few pages over and
over); a cache-on pool keeps finished prompts cached, so new requests take fresh pages and then evicted ones, spread
over the whole pool. This times decode-only steps (median per run) of both engines with both page orders,
alternating the four modes every round so drift hits them alike, and sums the paged-attention kernels' GPU time
over one profiled run per mode (`--profile`). The cache-on engine's cache is emptied before each run, so the
page order is the only difference a mode makes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

import torch
from one_batch import add_engine_flags, dummy_model_dir, engine_config, random_prompts, run_batch
from sections import write_json

from hybridserve.engine.llm_engine import LLMEngine


def order_pages(engine: LLMEngine, spread: bool, seed: int) -> None:
    """Empty the cache, then set the page free list's order: lowest ids first (packed) or a random permutation."""
    engine.reset_prefix_cache()
    pages = engine.pool.pages
    if pages is None:
        raise ValueError("the model has no attention layers: no KV pages to place")
    free = sorted(pages._free, reverse=True)  # allocate() pops from the end: lowest ids first
    if spread:
        random.Random(seed).shuffle(free)
    pages._free[:] = free


def attention_us(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """GPU time per decode-phase run of the paged-attention kernels and of all kernels (torch profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_batch(engine, prompts, output_len)
    total = attention = 0.0
    for event in prof.key_averages():
        us = event.device_time_total
        total += us
        if "paged" in event.key or "combine_splits" in event.key:
            attention += us
    return {"attention_us": attention, "all_kernels_us": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--batches", default="1,5,8")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.profile and not torch.cuda.is_available():
        raise ValueError("--profile times GPU kernels: it needs CUDA (leave it out on the CPU)")
    model_dir = Path(args.model) if args.model else dummy_model_dir(args.dummy_config)
    engines = {caching: LLMEngine(model_dir, engine_config(args, enable_prefix_caching=caching))
               for caching in (False, True)}
    modes = [(caching, spread) for caching in (False, True) for spread in (False, True)]
    vocab = engines[False].model_config.vocab_size
    steps: dict[str, dict[int, list[float]]] = {}
    seed = 0
    for round_index in range(args.rounds):
        order = modes if round_index % 2 == 0 else modes[::-1]
        for caching, spread in order:
            name = f"cache_{'on' if caching else 'off'}_{'spread' if spread else 'packed'}"
            for batch in batches:
                seed += 1
                order_pages(engines[caching], spread, seed)
                result = run_batch(engines[caching], random_prompts(batch, args.input_len, seed, vocab),
                                   args.output_len)
                steps.setdefault(name, {}).setdefault(batch, []).append(result["decode_step_ms_p50"])
    summary: dict[str, Any] = {name: {b: round(statistics.median(v), 4) for b, v in by_batch.items()}
                               for name, by_batch in steps.items()}
    for caching in ("off", "on"):
        packed, spread = summary[f"cache_{caching}_packed"], summary[f"cache_{caching}_spread"]
        summary[f"cache_{caching}_spread_over_packed"] = {b: round(spread[b] / packed[b], 4) for b in batches}
    on, off = summary["cache_on_packed"], summary["cache_off_packed"]
    summary["on_over_off_packed"] = {b: round(on[b] / off[b], 4) for b in batches}
    profiles: dict[str, Any] = {}
    if args.profile:
        for caching, spread in modes:
            name = f"cache_{'on' if caching else 'off'}_{'spread' if spread else 'packed'}"
            seed += 1
            order_pages(engines[caching], spread, seed)
            profiles[name] = attention_us(engines[caching], random_prompts(max(batches), args.input_len, seed, vocab),
                                          args.output_len)
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
        "decode_step_ms_p50": summary, "runs": steps, "profile_batch": max(batches), "profiles": profiles,
    }
    print(json.dumps(result["decode_step_ms_p50"], indent=2))
    write_json(result, Path(args.json) if args.json else None)


if __name__ == "__main__":
    main()
