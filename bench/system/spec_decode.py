"""Speculative decoding on the GPU: Nemotron-Nano-9B-v2 shapes, random bf16 weights, the real engine.

Random weights make real drafts meaningless, so acceptance is set by an oracle: each draft is accepted with
probability `rate` (0, 0.5, 1) until the first rejection; the verify pass, the state rollback and the
checkpoint writes all run for real. Per (batch, K, rollback, rate): decode tokens/s, ms per step, SSM state
bytes moved per step and state memory per request; plain decoding (eager and CUDA graph) is the baseline.

  python bench/system/spec_decode.py [--quick] [--out bench/results/<device>/spec_decode/spec_decode.json]

Floors: a verify step of T = K+1 tokens reads the weights once (like a decode step) plus the SSM state
traffic: plain 2S per request, intermediate (T+3)S (read, T per-token writes, rollback copy), replay 2S
(read + write after folding in the accepted tokens) — S = the request's SSM state bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "kernels")]
from decode_step import CONFIG, random_model  # noqa: E402

from hybridserve.common.model_config import ModelConfig  # noqa: E402
from hybridserve.common.sampling_params import SamplingParams  # noqa: E402
from hybridserve.engine import llm_engine  # noqa: E402
from hybridserve.engine.config import EngineConfig  # noqa: E402
from hybridserve.engine.llm_engine import LLMEngine  # noqa: E402
from hybridserve.engine.rejection import Acceptance  # noqa: E402

PROMPT_LEN = 128
MAX_LEN = 1024


def _patch_loader(model: torch.nn.Module) -> None:
    """The engine takes the in-memory random model instead of reading 18 GB of weights."""
    llm_engine.load_model = lambda *args, **kwargs: model  # type: ignore[assignment]


def _oracle_accept(engine: LLMEngine, rate: float, seed: int) -> None:
    """Acceptance by coin flips at `rate` per draft (the target's argmax supplies the emitted tokens)."""
    rng = random.Random(seed)
    spec = engine.spec
    assert spec is not None

    def acceptances(decodes, output):  # noqa: ANN001, ANN202 - replaces SpecDecoder._acceptances
        if not decodes or output.verify_logits is None:
            return []
        argmax = output.verify_logits.argmax(dim=-1).tolist()
        results = []
        for row, request in enumerate(decodes):
            drafts = request.draft_tokens
            kept = 0
            while kept < len(drafts) and rng.random() < rate:
                kept += 1
            spec.metrics.observe(len(drafts), kept)
            results.append(Acceptance(drafts[:kept] + [argmax[row][kept]], kept))
        return results

    spec._acceptances = acceptances  # type: ignore[method-assign]
    spec.set_drafter(lambda request: [request.all_token_ids[-1]] * spec.num_drafts)


def run_config(model_dir: str, batch: int, spec: dict | None, rate: float, graphs: bool, steps: int,
               device: str = "cuda", load_format: str = "safetensors") -> dict:
    config = EngineConfig(
        load_format=load_format,
        device=device, dtype="bfloat16" if device == "cuda" else "float32", max_num_seqs=batch, max_model_len=MAX_LEN,
        prefill_chunk_size=8192,
        enable_prefix_caching=False, cuda_graphs=graphs, gpu_memory_utilization=0.97, warmup=False,
        num_kv_pages=batch * (MAX_LEN // 16 + 8), speculative_config=spec,
        # on CPU the default budget fits the batch's own pages only, not the fixed page count above
        **({"cpu_memory_gb": 1.0} if device == "cpu" else {}),
    )
    engine = LLMEngine(model_dir, config)
    if spec is not None:
        _oracle_accept(engine, rate, seed=batch)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=MAX_LEN - PROMPT_LEN - 16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, min(1000, engine.model_config.vocab_size), (PROMPT_LEN,), generator=gen).tolist()
        engine.add_request(prompt, params, f"r{i}")
    while any(r.num_computed_tokens < PROMPT_LEN for r in engine._requests.values()):
        engine.step()
    for _ in range(3):  # warm-up decode / verify steps (Triton compiles; the engine's own warm-up is off)
        engine.step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    times, tokens = [], 0
    for _ in range(steps):
        before = sum(len(r.output_token_ids) for r in engine._requests.values())
        start = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - start)
        tokens += sum(len(r.output_token_ids) for r in engine._requests.values()) - before
    cache = engine.cache
    ssm_bytes = cache.ssm_states[0].numel() * cache.ssm_states.element_size()
    k = spec["num_speculative_tokens"] if spec else 0
    rollback = spec["rollback"] if spec else None
    moved = {None: 2, "intermediate": k + 4, "replay": 2}[rollback] * ssm_bytes * batch
    working = 0
    if rollback == "intermediate":
        working = (k + 1) * ssm_bytes
    elif rollback == "replay":
        working = sum(r.nbytes() for r in cache._replay) // cache.layout.num_slots
    row = {
        "batch": batch, "K": k, "rollback": rollback, "accept_rate": rate if spec else None, "cuda_graphs": graphs,
        "step_ms": statistics.median(times) * 1e3, "tokens_per_s": tokens / sum(times),
        "acceptance_length": engine.spec.metrics.acceptance_length if engine.spec else 1.0,
        "ssm_state_MB_per_request": ssm_bytes / 1e6, "state_GB_moved_per_step": moved / 1e9,
        "spec_working_MB_per_request": working / 1e6,
    }
    spec_decoder = engine.spec
    if spec_decoder is not None:  # break the oracle's reference cycle so the pools are freed now
        spec_decoder._acceptances = None  # type: ignore[assignment]
    del engine, spec_decoder, cache
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def graph_modes(text: str) -> list[bool]:
    """"eager,graph" -> [False, True]: whether each run captures CUDA graphs."""
    modes = {"eager": False, "graph": True}
    unknown = [m for m in text.split(",") if m not in modes]
    if unknown:
        raise argparse.ArgumentTypeError(f"modes are 'eager' and 'graph' (comma-separated), got {unknown}")
    return [modes[m] for m in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer configurations and steps")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32,64)")
    parser.add_argument("--ks", default=None, help="comma-separated draft counts K (default 1,2,3,4)")
    parser.add_argument("--rates", default="0,0.5,1", help="comma-separated oracle acceptance rates")
    parser.add_argument("--rollbacks", default="intermediate,replay")
    parser.add_argument("--dummy-config", type=Path, default=None,
                        help="config.json of a model to run with dummy weights instead of the 9B's random ones, e.g. "
                             "bench/configs/nemotron-3-nano-30b-a3b-mtp.json")
    parser.add_argument("--method", default="ngram", choices=("ngram", "mtp"),
                        help="the drafter that runs (its drafts are replaced by the oracle's; mtp: its cost stays in "
                             "the step)")
    parser.add_argument("--plain-graphs", type=graph_modes, default="eager,graph",
                        help="plain decoding baselines: eager, graph or both")
    parser.add_argument("--spec-graphs", type=graph_modes, default="eager,graph",
                        help="verify steps eager, captured as CUDA graphs, or both (side by side per config)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/system/spec_decode.py needs a CUDA device")
    config_text = (args.dummy_config or CONFIG).read_text()
    model_dir = tempfile.mkdtemp(prefix="spec-bench-")
    (Path(model_dir) / "config.json").write_text(config_text)
    # --dummy-config: the engine's own dummy weights (a model too big to build twice); else the 9B's random ones
    load_format = "dummy" if args.dummy_config is not None else "safetensors"
    if args.dummy_config is None:
        _patch_loader(random_model(ModelConfig.from_hf_dict(json.loads(config_text))))
    batches = (1, 32) if args.quick else (1, 8, 32, 64)
    ks = (2,) if args.quick else (1, 2, 3, 4)
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    if args.ks:
        ks = tuple(int(k) for k in args.ks.split(","))
    rates = [float(r) for r in args.rates.split(",")]
    steps = 8 if args.quick else 12
    rows: list[dict[str, Any]] = []

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if args.out:  # after every row: a crash keeps what was measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))

    for batch in batches:
        for graphs in args.plain_graphs:
            record(run_config(model_dir, batch, None, 0.0, graphs, steps, load_format=load_format))
        for k in ks:
            for rollback in args.rollbacks.split(","):
                for rate in rates:
                    spec = {"method": args.method, "num_speculative_tokens": k, "rollback": rollback}
                    for graphs in args.spec_graphs:
                        try:
                            record(run_config(model_dir, batch, spec, rate, graphs, steps, load_format=load_format))
                        except (torch.cuda.OutOfMemoryError, ValueError) as exc:  # pools that do not fit
                            record({"batch": batch, "K": k, "rollback": rollback, "accept_rate": rate,
                                    "cuda_graphs": graphs, "error": str(exc)[:300]})
                            gc.collect()
                            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
