"""Does a lone request pay for the time the engine sat idle before it? TTFT of single fresh prompts after idle gaps.

    python bench/system/first_request.py --input-len 1024 --gaps 0,0.5,2,5,15 --repeats 3 --out first_request.json

The served "first request after ready" comes 25-30 ms slower than the same-length requests after it
(bench/results/h200/serving/), with no Triton compile and no garbage collection in it. Here the
offline engine (the serving benchmark's settings, warmed up) takes one fresh prompt at a time after each idle gap
(gaps in shuffled order, `--repeats` times each) and times its prefill until the first token, with the GPU's SM
clock read just before the request (NVML, where torch can read it). If the TTFT grows with the gap, the cost is
the idle device (clocks), not the server.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from one_batch import add_engine_flags, dummy_model_dir, engine_config, random_prompts, sync

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.llm_engine import LLMEngine


def sm_clock_mhz() -> int | None:
    """The device's current SM clock (NVML through torch), None where it cannot be read."""
    if not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 - no NVML binding: the timings stand alone
        return None


def ttft_ms(engine: LLMEngine, prompt: list[int]) -> float:
    """Milliseconds from adding `prompt` to its first token, the engine otherwise idle."""
    sync(engine)
    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.num_tokens and first is None:
                sync(engine)
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("the request finished without a token")
    return 1e3 * (first - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--gaps", default="0,0.5,2,5,15", help="idle seconds before a request, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    gaps = [float(g) for g in args.gaps.split(",")]
    model_dir = Path(args.model) if args.model else dummy_model_dir(args.dummy_config)
    engine = LLMEngine(model_dir, engine_config(args))  # warmed up before it returns (CUDA)
    vocab = engine.model_config.vocab_size
    plan = [g for g in gaps for _ in range(args.repeats)]
    random.Random(args.seed).shuffle(plan)
    prompts = random_prompts(len(plan) + 1, args.input_len, args.seed + 1, vocab)
    first_after_start = ttft_ms(engine, prompts[-1])  # the first request after the warm-up, no gap added
    samples: dict[float, list[dict]] = {g: [] for g in gaps}
    for gap, prompt in zip(plan, prompts):
        time.sleep(gap)
        clock = sm_clock_mhz()
        samples[gap].append({"ttft_ms": round(ttft_ms(engine, prompt), 3), "sm_clock_mhz_before": clock})
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "input_len": args.input_len, "repeats": args.repeats,
        "first_after_start_ms": round(first_after_start, 3),
        "by_gap": {f"{g:g}": {"ttft_ms_median": statistics.median(s["ttft_ms"] for s in samples[g]), "samples": samples[g]}
                   for g in gaps},
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
