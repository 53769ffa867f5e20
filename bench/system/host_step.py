"""Host time of one decode step at production batch: the real engine with its forward stubbed out.

    python bench/system/host_step.py --rows 256,512,1024 --steps 40 [--profile DIR] [--json OUT]

The engine (scheduler, state pool with prefix caching, batch builder, sampler, update, stop rules, outputs) runs
on the CPU on a miniature NemotronH config; the model's forward returns zeros at once and the LM head returns
fixed logits, so every millisecond measured is host work the GPU step would have to hide. Each row count runs
`rows` requests of --prompt-len tokens (prefilled first, untimed) and times --steps decode-only steps, split
into the engine's phases (with async scheduling, those of one step call: launching step N+1, waiting for step N's
tokens, applying them), then the worker's output path for the same outputs: the session's per-step message
(`decode_worker/session.py`: one TokenEvent per request, serialized) and the router's parse of it. `--profile`
writes a cProfile listing of the timed steps per row count.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.proto import worker_pb2
from hybridserve.proto.convert import token_event

TINY = {  # a NemotronH in miniature: the host's work per row does not depend on the model's width
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 4, "hybrid_override_pattern": "M*ME", "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 8192, "mamba_num_heads": 4,
    "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 2, "conv_kernel": 4, "expand": 2, "chunk_size": 128,
    "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 32, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "mamba_ssm_cache_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def stub_forward(engine: LLMEngine, seed: int) -> None:
    """The runner's forward returns zeros and its LM head fixed random logits (tokens vary by row)."""
    runner = engine.runner
    hidden = engine.model_config.hidden_size
    vocab = engine.model_config.vocab_size
    table = torch.randn(8192, vocab, generator=torch.Generator().manual_seed(seed))  # [rows, V]

    def forward(input_ids: torch.Tensor, batch: Any) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], hidden)

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        return table[: h.shape[0]]

    runner.forward = forward  # type: ignore[method-assign]
    runner.compute_logits = compute_logits  # type: ignore[method-assign]


def build_engine(model_dir: Path, rows: int, max_model_len: int, async_scheduling: bool) -> LLMEngine:
    pages = rows * (-(-max_model_len // 16) + 2) + 1024  # room for every row and the prefill chunk kept free
    fields: dict[str, Any] = dict(device="cpu", dtype="float32", load_format="dummy", max_num_seqs=rows,
                                  max_model_len=max_model_len, num_kv_pages=pages, num_checkpoint_slots=8,
                                  prefill_chunk_size=8192, max_num_waiting=rows + 1, warmup=False)
    if "async_scheduling" in EngineConfig.__dataclass_fields__:
        fields["async_scheduling"] = async_scheduling
    return LLMEngine(model_dir, EngineConfig(**fields))


def session_message(outputs: list[Any], sent: dict[str, int]) -> bytes:
    """The decode worker's per-step SessionEvents for these outputs, serialized (decode_worker/session.py)."""
    message = worker_pb2.SessionEvents()
    for out in outputs:
        prior = sent.get(out.request_id, 0)
        message.events.append(token_event(out, prior))
        sent[out.request_id] = out.num_tokens  # as the session counts it (no copy of the list)
    return message.SerializeToString()


class BusyThreads:
    """Threads doing what a worker's I/O threads do beside its engine loop (building and serializing token events,
    pure Python holding the GIL): the loop's torch calls release the GIL, and taking it back waits on them."""

    def __init__(self, count: int, duty: float = 1.0, period_s: float = 0.02) -> None:
        self.duty, self.period_s = duty, period_s  # busy for duty x period, then asleep for the rest
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            while time.perf_counter() - start < self.duty * self.period_s:
                self._serialize()
            if self.duty < 1.0:
                self.stop.wait(self.period_s * (1.0 - self.duty))

    @staticmethod
    def _serialize() -> None:
        message = worker_pb2.SessionEvents()
        for i in range(64):
            event = message.events.add()
            event.request_id = f"r{i}"
            event.token_ids.extend(range(i, i + 4))
        message.SerializeToString()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def run_rows(model_dir: Path, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    # rows decode while later ones prefill: max_tokens leaves every row running through the timed steps
    max_tokens = args.prompt_len // 2 + args.steps + 10
    engine = build_engine(model_dir, rows, args.prompt_len + max_tokens + 64, args.async_scheduling)
    stub_forward(engine, 0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=args.temperature, seed=None)
    g = torch.Generator().manual_seed(rows)
    for i in range(rows):
        prompt = torch.randint(3, 250, (args.prompt_len,), generator=g).tolist()
        engine.add_request(prompt, params, f"r{i}")
    sent: dict[str, int] = {}
    while any(not r.is_decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        session_message(engine.step(), sent)  # prefill (untimed)
    for _ in range(3):  # async scheduling: the last prefill steps are still being applied
        session_message(engine.step(), sent)
    phases: dict[str, list[float]] = {k: [] for k in ("schedule", "launch", "wait", "update", "step", "step_cpu",
                                                      "message", "router_parse")}
    busy = BusyThreads(args.busy_threads, args.busy_duty)
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        t1, c1 = time.perf_counter(), time.thread_time()
        data = session_message(outputs, sent)
        t2 = time.perf_counter()
        parsed = worker_pb2.SessionEvents.FromString(data)
        for event in parsed.events:  # the router's reader hands each event to its stream
            _ = (event.request_id, list(event.token_ids))
        t3 = time.perf_counter()
        timing = engine.last_step
        assert timing.decode_rows == rows, (timing.decode_rows, rows)
        phases["schedule"].append(timing.schedule * 1e3)
        phases["launch"].append(timing.launch * 1e3)
        phases["wait"].append((timing.while_running + timing.wait) * 1e3)
        phases["update"].append(timing.update * 1e3)
        phases["step"].append((t1 - t0) * 1e3)
        phases["step_cpu"].append((c1 - c0) * 1e3)  # the thread's CPU time: robust to a shared machine's load
        phases["message"].append((t2 - t1) * 1e3)
        phases["router_parse"].append((t3 - t2) * 1e3)
    busy.close()
    if args.profile is not None:  # separate steps: cProfile's own cost would inflate the timings above
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10):
            session_message(engine.step(), sent)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        args.profile.mkdir(parents=True, exist_ok=True)
        (args.profile / f"rows{rows}.txt").write_text(text.getvalue())
    engine.pool.check()
    result: dict[str, Any] = {"rows": rows, "median_ms": {k: round(statistics.median(v), 3) for k, v in phases.items()},
                              "min_ms": {k: round(min(v), 3) for k, v in phases.items()}}
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="256,512,1024", help="running rows, comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per row count")
    parser.add_argument("--prompt-len", type=int, default=1536,
                        help="context of each row (1,536: the mean of a 1k/1k request mid-decode)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the benchmark's setting)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="async scheduling on (the engine's default; without it the synchronous step is timed)")
    parser.add_argument("--busy-threads", type=int, default=0,
                        help="Python threads serializing token events during the timed steps (a worker's I/O)")
    parser.add_argument("--busy-duty", type=float, default=1.0,
                        help="the share of each 20 ms the busy threads work (1: always)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="CPython's GIL switch interval in ms (default: the interpreter's, 5 ms)")
    parser.add_argument("--profile", type=Path, default=None, help="folder for cProfile listings")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(TINY))
        results = [run_rows(model_dir, int(r), args) for r in args.rows.split(",")]
    header = list(results[0]["median_ms"])
    print("| rows | " + " | ".join(f"{h} ms" for h in header) + " | min step / step_cpu ms |")
    print("|---" * (len(header) + 2) + "|")
    for r in results:
        print(f"| {r['rows']} | " + " | ".join(f"{r['median_ms'][h]:.2f}" for h in header)
              + f" | {r['min_ms']['step']:.2f} / {r['min_ms']['step_cpu']:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
