"""Prefix cache on vs off with both engines alive in one process, their steps interleaved one for one.

    python bench/mixed_step_interleaved.py --decode-rows 1 4 8 --prompt-len 1024 --repeats 30 --out FILE

`mixed_step.py` builds the engines one after the other; on a shared host whose speed drifts by ~10 % over
minutes that leaves a difference of a few % unresolved. Here both engines hold N decoding requests and take
turns: a mixed step (one fresh 1024-token prompt beside the N decodes) and a decode-only step on the cache-off
engine, then the same on the cache-on engine, `--repeats` times, so any drift hits both alike. Reports the
median and the median of the per-pair ratios (on / off).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from mixed_step import StepTimer, start_decoders
from one_batch import add_engine_flags, dummy_model_dir, engine_config, random_prompts

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.llm_engine import LLMEngine


def pair_rows(engines: dict[str, LLMEngine], rows: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    timer = StepTimer(torch.cuda.is_available())
    decoders = {key: start_decoders(engine, rows, args.prompt_len, seed) for key, engine in engines.items()}
    times: dict[str, dict[str, list[float]]] = {key: {"mixed": [], "decode": []} for key in engines}
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i in range(args.repeats):
        for key, engine in engines.items():  # the same fresh prompt for both engines
            prompt = random_prompts(1, args.prompt_len, seed * 1000 + i + 1, engine.model_config.vocab_size)[0]
            rid = engine.add_request(prompt, params)
            times[key]["mixed"].append(timer(engine)[0])
            engine.abort(rid)
            times[key]["decode"].append(timer(engine)[0])
    for key, engine in engines.items():
        for rid in decoders[key]:
            engine.abort(rid)
        engine.step()
    out: dict[str, Any] = {"decode_rows": rows}
    for kind in ("mixed", "decode"):
        off, on = times["off"][kind], times["on"][kind]
        out[f"{kind}_ms_p50_off"] = round(statistics.median(off), 3)
        out[f"{kind}_ms_p50_on"] = round(statistics.median(on), 3)
        out[f"{kind}_on_over_off_p50_of_pairs"] = round(statistics.median(b / a for a, b in zip(off, on)), 4)
        out[f"{kind}_ms_off"], out[f"{kind}_ms_on"] = [round(t, 3) for t in off], [round(t, 3) for t in on]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args()
    model_dir = dummy_model_dir(args.dummy_config) if args.model is None else Path(args.model)
    engines = {key: LLMEngine(model_dir, engine_config(args, enable_prefix_caching=key == "on")) for key in ("off", "on")}
    results = []
    for seed, rows in enumerate(args.decode_rows):
        result = pair_rows(engines, rows, args, seed + 1)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}), flush=True)
    if args.out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        Path(args.out).write_text(json.dumps({"device": device, "args": vars(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
