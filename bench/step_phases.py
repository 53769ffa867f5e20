"""Where one engine step's time goes, per engine variant, side by side in one process: host phases and GPU time.

    python bench/step_phases.py --modes graphs,cache --prompt-len 1024 --decode-rows 0 4 --repeats 15 --out FILE

Each engine (`prefill_graph_ab.MODES`) prefills one fresh prompt per repeat (beside N running decodes), the engines
taking turns. The step is cut into schedule, checkpoint planning, launch (from `execute` to the forward queued),
the `while_running` work (the prefix cache's early commit, overlapping the GPU), the wait for the sampled tokens,
and the update (appending tokens, the pool's commit, finishing); the forward's GPU time comes from CUDA events
around the model call. Medians over the repeats, milliseconds; the difference between modes is where e.g. the
prefix cache's cost on unique prompts lies.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from one_batch import add_engine_flags, dummy_model_dir, engine_config, random_prompts, sync
from prefill_graph_ab import MODES
from sections import write_json

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.llm_engine import LLMEngine


class _GpuTimedModel:
    """The runner's model with CUDA events around each call (other attributes pass through)."""

    def __init__(self, model: Any, record: Callable[[str, float], None]) -> None:
        self._model, self._record = model, record
        self._pending: list[tuple[Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.cuda.is_available():
            return self._model(*args, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self._model(*args, **kwargs)
        end.record()
        self._pending.append((start, end))
        return out

    def flush(self) -> None:
        for start, end in self._pending:
            end.synchronize()
            self._record("forward_gpu", start.elapsed_time(end))
        self._pending.clear()


def instrument(engine: LLMEngine) -> tuple[dict[str, list[float]], _GpuTimedModel]:
    """Wrap the step's phases with host timers; returns the per-phase lists of the current step."""
    phases: dict[str, list[float]] = defaultdict(list)

    def record(name: str, ms: float) -> None:
        phases[name].append(ms)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record(name, 1e3 * (time.perf_counter() - start))
        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    engine.pool.plan_checkpoints = timed("plan", engine.pool.plan_checkpoints)  # type: ignore[method-assign]
    engine.scheduler.update_from_output = timed("update", engine.scheduler.update_from_output)  # type: ignore[method-assign]
    execute = engine.runner.execute

    def execute_timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        marks: dict[str, float] = {}
        hook = kwargs.get("while_running")

        def while_running() -> None:
            marks["queued"] = time.perf_counter()
            if hook is not None:
                hook()
            marks["hooked"] = time.perf_counter()

        kwargs["while_running"] = while_running
        out = execute(*args, **kwargs)
        end = time.perf_counter()
        record("launch", 1e3 * (marks["queued"] - start))
        record("while_running", 1e3 * (marks["hooked"] - marks["queued"]))
        record("wait_tokens", 1e3 * (end - marks["hooked"]))
        return out

    engine.runner.execute = execute_timed  # type: ignore[method-assign]
    model = _GpuTimedModel(engine.runner.model, record)
    engine.runner.model = model  # type: ignore[assignment]
    return phases, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    parser.add_argument("--modes", default="graphs,cache")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else dummy_model_dir(args.dummy_config)
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        parser.error(f"modes must be of {sorted(MODES)}")
    engines = {m: LLMEngine(model_dir, engine_config(args, **{"enable_prefix_caching": False, **MODES[m]}))
               for m in modes}
    vocab = engines[modes[0]].model_config.vocab_size
    rows_out = []
    seed = iter(range(1, 10**6))
    for rows in args.decode_rows:
        decoders = {}
        for mode, engine in engines.items():
            params = SamplingParams(max_tokens=10**6, ignore_eos=True)
            decoders[mode] = [engine.add_request(p, params) for p in random_prompts(rows, 64, 999, vocab)]
            while engine.scheduler.waiting or any(not r.is_decoding for r in engine.scheduler.running):
                engine.step()
        per_mode: dict[str, dict[str, list[float]]] = {m: defaultdict(list) for m in modes}
        instruments = {}
        for mode, engine in engines.items():
            instruments[mode] = instrument(engine)
        for _ in range(args.repeats + 2):  # the first two are dropped (warm-up of the wrappers' paths)
            prompt_seed = next(seed)
            for mode, engine in engines.items():
                phases, model = instruments[mode]
                phases.clear()
                sync(engine)
                prompt = random_prompts(1, args.prompt_len, prompt_seed, vocab)[0]
                engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
                start = time.perf_counter()
                engine.step()
                sync(engine)
                wall = 1e3 * (time.perf_counter() - start)
                model.flush()
                per_mode[mode]["step_wall"].append(wall)
                for name, values in phases.items():
                    per_mode[mode][name].append(sum(values))
        for mode, engine in engines.items():
            engine.runner.model = instruments[mode][1]._model  # type: ignore[assignment]
            for rid in decoders[mode]:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
        for mode in modes:
            rows_out.append({"mode": mode, "decode_rows": rows, **{
                f"{name}_ms": round(statistics.median(values[2:]), 3) for name, values in per_mode[mode].items()}})
            print(rows_out[-1], flush=True)
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "prompt_len": args.prompt_len, "repeats": args.repeats, "rows": rows_out}
    write_json(result, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
