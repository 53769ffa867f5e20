"""The offline engine on one batch: prefill time and decode step time, the figures the server is held to.

    python bench/system/one_batch.py --batch 32 --input-len 256 --output-len 32 [--model DIR] [--json OUT]

Without --model it builds Nemotron-Nano-9B-v2 shapes with random weights (`--load-format dummy`). It runs the
batch once to warm up (compiles, autotune, CUDA graphs) and then `--repeats` times; each run reports the time
to the last first token (the batch's prefill) and the median decode step (output tokens after the first).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.step_timing import PHASES

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "nemotron-nano-9b-v2.json"


def dummy_model_dir(config: Path = CONFIG) -> Path:
    """A directory holding only a config.json (default Nemotron-Nano-9B-v2's) for --load-format dummy."""
    directory = Path(tempfile.mkdtemp(prefix="hybridserve-bench-"))
    (directory / "config.json").write_text(config.read_text())
    return directory


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The engine settings the serving benchmark uses (bench/serving/serve_gpu.sh), from the shared flags."""
    cuda = torch.cuda.is_available()
    fields: dict[str, Any] = dict(
        device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
        load_format="dummy" if args.model is None else "safetensors", max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, gpu_memory_gb=args.gpu_memory_gb if cuda else None,
        prefill_chunk_size=args.prefill_chunk_size, prefill_cuda_graphs=not args.no_prefill_cuda_graphs,
        moe_fp8_activations=args.moe_fp8_activations,
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: 9B shapes, dummy weights)")
    parser.add_argument("--dummy-config", type=Path, default=CONFIG,
                        help="config.json of the dummy-weight model without --model (e.g. "
                             "bench/configs/nemotron-3-nano-30b-a3b.json)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-gb", type=float, default=24.0)
    parser.add_argument("--prefill-chunk-size", type=int, default=None, help="default: the engine's for the device")
    parser.add_argument("--no-prefill-cuda-graphs", action="store_true", help="prefill steps eagerly (A/B)")
    parser.add_argument("--moe-fp8-activations", action=argparse.BooleanOptionalAction, default=True,
                        help="fp8 experts: W8A8 expert GEMMs (the engine's default; A/B)")


def random_prompts(count: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 1000)) for _ in range(length)] for _ in range(count)]


class CompileCounter:
    """Counts Triton JIT compiles (autotune candidates included) through Triton's post-compile hook."""

    def __init__(self) -> None:
        self.count = 0
        self.names: collections.Counter[str] = collections.Counter()
        self.log: list[str] = []
        try:
            from triton import knobs

            knobs.runtime.jit_post_compile_hook = self._hook
        except Exception:  # noqa: BLE001 - no Triton (CPU): nothing compiles
            pass

    def _hook(self, *args: Any, **kwargs: Any) -> bool:
        self.count += 1
        fn = kwargs.get("fn")
        name = str(getattr(fn, "name", "?"))
        self.names[name] += 1
        self.log.append(f"{name}: {kwargs.get('repr', '')}"[:3000])  # which specialization was compiled
        return False


def sync(engine: LLMEngine) -> None:
    if engine.config.torch_device.type == "cuda":
        torch.cuda.synchronize()


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Add the batch, step to the end; prefill = until every request has its first token."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    sync(engine)
    start = time.perf_counter()
    ids = {engine.add_request(p, params) for p in prompts}
    first: set[str] = set()
    prefill_s = 0.0
    step_times: list[float] = []
    phases: list[tuple[float, ...]] = []  # engine.last_step's phases of the decode steps
    steps_with_prefill = 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        if len(first) == len(ids):
            step_times.append(t1 - t0)
            phases.append(engine.last_step.phases())
        else:
            steps_with_prefill += 1
        for out in outs:
            if out.num_tokens:
                first.add(out.request_id)
        if len(first) == len(ids) and not prefill_s:
            prefill_s = t1 - start
    sync(engine)
    return {
        "prefill_s": prefill_s,
        "prefill_tok_per_s": sum(len(p) for p in prompts) / prefill_s,
        "prefill_steps": steps_with_prefill,
        "decode_step_ms_p50": 1e3 * statistics.median(step_times) if step_times else 0.0,
        "decode_steps": len(step_times),
        # where a decode step's time goes (schedule, launch, while_running, wait, update): medians, ms
        "decode_phase_ms_p50": {name: 1e3 * statistics.median(p[i] for p in phases) for i, name in enumerate(PHASES)}
        if phases else {},
        "total_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--profile", default=None, help="also profile one more batch (torch.profiler table here)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="with the prefix cache on (unique prompts: what caching costs them)")
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else dummy_model_dir(args.dummy_config)
    compiles = CompileCounter()
    t0 = time.perf_counter()
    engine = LLMEngine(model_dir, engine_config(args, enable_prefix_caching=args.prefix_caching))
    startup_compiles = compiles.count
    load_s = time.perf_counter() - t0
    prompts = random_prompts(args.batch, args.input_len, 0, engine.model_config.vocab_size)
    before = len(compiles.log)
    cold = run_batch(engine, prompts, args.output_len)
    cold["compiles_at_startup"] = startup_compiles
    cold["compiled_in_first_batch"] = compiles.log[before:]  # [] when the warm-up covered every launch
    runs = [run_batch(engine, random_prompts(args.batch, args.input_len, i + 1, engine.model_config.vocab_size),
                      args.output_len) for i in range(args.repeats)]
    result = {
        "batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "load_s": load_s, "cold": cold,
        "prefill_s_p50": statistics.median(r["prefill_s"] for r in runs),
        "prefill_tok_per_s_p50": statistics.median(r["prefill_tok_per_s"] for r in runs),
        "decode_step_ms_p50": statistics.median(r["decode_step_ms_p50"] for r in runs),
        "decode_phase_ms_p50": {name: statistics.median(r["decode_phase_ms_p50"][name] for r in runs)
                                for name in PHASES} if all(r["decode_phase_ms_p50"] for r in runs) else {},
        "runs": runs,
    }
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            run_batch(engine, random_prompts(args.batch, args.input_len, 99, engine.model_config.vocab_size),
                      args.output_len)
        table = prof.key_averages()
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        Path(args.profile).write_text(table.table(sort_by=sort, row_limit=40) + "\n\n"
                                      + table.table(sort_by="cpu_time_total", row_limit=40))
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
