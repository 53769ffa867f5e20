"""Engine variants side by side, same process, same GPU: TTFT of a lone fresh prompt per length, and the wall time
of a step that prefills one fresh prompt beside running decodes.

    python bench/prefill_graph_ab.py --lens 128,512,1000,1024,1100,1280,2048 --decode-rows 4 --repeats 7 --out ab.json
    python bench/prefill_graph_ab.py --modes graphs,fold,cache,eager --lens 128,512,1024 --gpu-memory-gb 8

One engine per mode (`MODES`: prefill graphs, eager prefill, decode rows folded into the prefill graph, prefix cache
on; the serving benchmark's settings otherwise, every prompt fresh so it is computed whole) is built side by side;
each measurement alternates between them so drift hits all alike. A prompt pads to the next token bucket
(engine/prefill_graphs.py): lengths between buckets show what the padding costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from one_batch import add_engine_flags, dummy_model_dir, engine_config, random_prompts, sync
from sections import write_json

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.llm_engine import LLMEngine

# mode -> engine settings that differ from the baseline (prefill graphs, split mixed steps, prefix cache off)
MODES: dict[str, dict[str, bool]] = {
    "graphs": {},
    "eager": {"prefill_cuda_graphs": False},
    "fold": {"fold_decode_rows": True},
    "cache": {"enable_prefix_caching": True},
    "fold-cache": {"fold_decode_rows": True, "enable_prefix_caching": True},
}


def lone_ttft_ms(engine: LLMEngine, prompt: list[int]) -> float:
    """Milliseconds from adding `prompt` to its first token, nothing else running."""
    sync(engine)
    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sync(engine)
    if rid in engine._requests:
        raise RuntimeError(f"request {rid} did not finish")
    return 1e3 * (time.perf_counter() - start)


def mixed_step_ms(engine: LLMEngine, prompt: list[int]) -> float:
    """Wall milliseconds of the step that prefills `prompt` beside the engine's running decodes."""
    sync(engine)
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    sync(engine)
    took = 1e3 * (time.perf_counter() - start)
    while engine.scheduler.waiting or any(not r.is_decoding for r in engine.scheduler.running):
        engine.step()  # a prompt longer than one step's budget
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--modes", default="graphs,eager", help=f"comma-separated, of {sorted(MODES)}")
    parser.add_argument("--lens", default="128,512,1024,1100,2048")
    parser.add_argument("--decode-rows", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else dummy_model_dir(args.dummy_config)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {sorted(MODES)}")
    engines = {mode: LLMEngine(model_dir, engine_config(args, **{"enable_prefix_caching": False, **MODES[mode]}))
               for mode in modes}
    vocab = engines[modes[0]].model_config.vocab_size
    lens = [int(n) for n in args.lens.split(",")]
    seed = iter(range(10**6))
    lone: dict[str, dict[int, list[float]]] = {m: {n: [] for n in lens} for m in engines}
    for _ in range(args.repeats):
        for n in lens:
            for mode, engine in engines.items():
                lone[mode][n].append(lone_ttft_ms(engine, random_prompts(1, n, next(seed), vocab)[0]))
    long_params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    for engine in engines.values():  # decodes that run for the rest of the benchmark
        for prompt in random_prompts(args.decode_rows, 64, 999, vocab):
            engine.add_request(prompt, long_params)
        while any(not r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
    mixed: dict[str, dict[int, list[float]]] = {m: {n: [] for n in lens} for m in engines}
    for _ in range(args.repeats):
        for n in lens:
            for mode, engine in engines.items():
                mixed[mode][n].append(mixed_step_ms(engine, random_prompts(1, n, next(seed), vocab)[0]))
    rows = [{"prompt_tokens": n, **{f"{kind}_{mode}_ms": round(statistics.median(table[mode][n]), 2)
                                    for kind, table in (("lone_ttft", lone), ("mixed_step", mixed))
                                    for mode in engines}} for n in lens]
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "decode_rows": args.decode_rows, "repeats": args.repeats, "rows": rows,
              "graph_stats": {mode: e.graph_stats() for mode, e in engines.items()},
              "buckets": {mode: list(getattr(getattr(e.runner.model, "prefill", None), "buckets", ()))
                          for mode, e in engines.items()}}
    print(json.dumps(result, indent=1))
    write_json(result, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
