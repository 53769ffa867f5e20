"""Prefix-cache benchmark: TTFT and prefill tokens computed with and without the cache.

Workloads (all requests of a phase arrive at once, greedy, on a random NemotronH checkpoint written with
transformers' `save_pretrained`):
  shared   — N chats sharing a long system prompt, each with its own user message;
  turn2    — the same N chats' second turn: turn-1 prompt + its answer + a new user message (the
             decode-side checkpoints let it reuse the answer too);
  unique   — N prompts with nothing in common (the cache can only cost here: it must not).
Each workload runs on a fresh engine with `enable_prefix_caching` on and off, after one warm-up request.

  python bench/system/prefix_cache.py                      # CPU, writes bench/results/cpu/prefix_cache/prefix_cache.json
  python bench/system/prefix_cache.py --device cuda --out prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridserve import LLM, SamplingParams
from hybridserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("bench.prefix_cache")

MODEL = dict(
    vocab_size=512,
    hidden_size=256,
    hybrid_override_pattern="M-M*M-M*",
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=512,
    mamba_num_heads=8,
    mamba_head_dim=32,
    ssm_state_size=32,
    n_groups=2,
    conv_kernel=4,
    chunk_size=64,
    max_position_embeddings=8192,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
)


def write_model(directory: Path) -> Path:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    NemotronHForCausalLM(NemotronHConfig(**MODEL)).save_pretrained(str(directory))
    return directory


def _tokens(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, MODEL["vocab_size"], (n,), generator=generator).tolist()


def run_phase(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit all prompts at once and step to completion; TTFT per request and prefill tokens computed."""
    computed = 0
    schedule = engine.scheduler.schedule

    def counting_schedule():  # noqa: ANN202 - SchedulerOutput
        nonlocal computed
        out = schedule()
        computed += sum(c.num_tokens for c in out.prefills)
        return out

    engine.scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            if out.finished:
                outputs[out.request_id] = out.token_ids
                cached[out.request_id] = out.num_cached_tokens
    total = time.perf_counter() - start
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    ttft = [first[i] for i in ids]
    return {
        "ttft_s": {
            "mean": statistics.mean(ttft),
            "p50": statistics.median(ttft),
            "max": max(ttft),
            "first_request": ttft[0],
        },
        "wall_s": total,
        "prompt_tokens": sum(len(p) for p in prompts),
        "prefill_tokens_computed": computed,
        "cached_tokens": sum(cached.values()),
        "outputs": [outputs[i] for i in ids],
    }


def workloads(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    gen = torch.Generator().manual_seed(1)
    system = _tokens(gen, args.system_len)
    shared = [system + _tokens(gen, args.user_len) for _ in range(args.num_requests)]
    unique = [_tokens(gen, args.system_len + args.user_len) for _ in range(args.num_requests)]
    return {"shared": shared, "unique": unique}


def bench(args: argparse.Namespace, model_dir: Path, caching: bool) -> dict:
    llm = LLM(
        model_dir,
        device=args.device,
        enable_prefix_caching=caching,
        max_model_len=args.system_len + 2 * args.user_len + args.answer_len + args.max_tokens + 64,
        prefill_chunk_size=args.prefill_chunk_size,
        max_num_seqs=args.num_requests,
        cpu_memory_gb=args.cpu_memory_gb,
        state_block=args.state_block,
    )
    engine = llm.engine
    gen = torch.Generator().manual_seed(2)
    # warm-up: allocations, lazy inits, and Triton compiles for chunked prefills that cross checkpoints
    run_phase(engine, [_tokens(gen, 64), _tokens(gen, args.prefill_chunk_size + 64)], 2)
    engine.reset_prefix_cache()
    prompts = workloads(args)
    results = {"shared": run_phase(engine, prompts["shared"], args.answer_len)}
    turn2 = [
        p + out + _tokens(gen, args.user_len) for p, out in zip(prompts["shared"], results["shared"]["outputs"])
    ]
    results["turn2"] = run_phase(engine, turn2, args.max_tokens)
    engine.reset_prefix_cache()
    results["unique"] = run_phase(engine, prompts["unique"], args.max_tokens)
    engine.pool.check()
    return results


def _median_run(runs: list[dict]) -> dict:
    """Per workload, the run with the median mean TTFT (a whole run, so its numbers stay consistent)."""
    out = {}
    for phase in runs[0]:
        ranked = sorted(runs, key=lambda r: r[phase]["ttft_s"]["mean"])
        out[phase] = ranked[len(ranked) // 2][phase]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--user-len", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated in turn 2 and unique")
    parser.add_argument("--answer-len", type=int, default=224,
                        help="turn-1 answer length; 224 lets decode cross the next state_block boundary, so "
                        "turn 2 hits past the turn-1 prompt")
    parser.add_argument("--prefill-chunk-size", type=int, default=512)
    parser.add_argument("--cpu-memory-gb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting; the median is reported")
    parser.add_argument("--state-block", type=int, default=None, help="checkpoint interval (engine default)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier on a shared machine)")
    results = Path(__file__).resolve().parents[1] / "results"
    parser.add_argument("--out", type=Path, default=results / "cpu" / "prefix_cache" / "prefix_cache.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp))
        for repeat in range(args.repeats):  # alternate the order so warm-up and drift hit both sides
            for caching in (False, True) if repeat % 2 == 0 else (True, False):
                runs[caching].append(bench(args, model_dir, caching))
    off, on = _median_run(runs[False]), _median_run(runs[True])
    rows = []
    for phase in ("shared", "turn2", "unique"):
        same = on[phase].pop("outputs") == off[phase].pop("outputs")
        rows.append({
            "workload": phase,
            "cache_off": off[phase],
            "cache_on": on[phase],
            "ttft_mean_speedup": off[phase]["ttft_s"]["mean"] / on[phase]["ttft_s"]["mean"],
            "same_tokens": same,
            "ttft_never_worse": all(
                on[phase]["ttft_s"][k] <= off[phase]["ttft_s"][k] * 1.05 for k in ("mean", "p50", "max")
            ),
        })
    header = (f"{'workload':<8} {'cache':<5} {'TTFT mean':>10} {'p50':>8} {'max':>8} {'first':>8} "
              f"{'prefill tok':>12} {'cached':>8}")
    print(header)
    for row in rows:
        for name in ("cache_off", "cache_on"):
            r = row[name]
            t = r["ttft_s"]
            print(f"{row['workload']:<8} {name[6:]:<5} {t['mean']:>9.3f}s {t['p50']:>7.3f}s {t['max']:>7.3f}s "
                  f"{t['first_request']:>7.3f}s {r['prefill_tokens_computed']:>12} {r['cached_tokens']:>8}")
        print(f"{'':<8} TTFT mean speedup {row['ttft_mean_speedup']:.2f}x, same tokens: {row['same_tokens']}")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = {
        "benchmark": "prefix_cache",
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": MODEL,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
