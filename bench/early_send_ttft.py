"""TTFT of long prompts with the gRPC state transfer overlapped with prefill (`grpc_early_send`) vs not.

One decode worker and two prefill workers as plain processes (no Ray), all on one device: prefill worker
"early" streams the KV of each finished prefill chunk while later chunks compute, prefill worker "late" sends
the whole state after the first token (both over the gRPC plane, the only plane besides NIXL the overlap
helps). The floor from the same run: the decode worker prefilling the prompt itself (no transfer). Each
request is timed from the orchestrator's call to its first token event (what a client sees as TTFT); fresh
random prompts every run (no prefix-cache hits), modes interleaved, median of --runs after a warm-up.

  GPU: python bench/early_send_ttft.py --device cuda --tokens 8192 16384 --runs 5     (~2-3 min on one H200)
  CPU smoke: python bench/early_send_ttft.py --device cpu --tokens 256 512 --runs 2 --prefill-chunk-size 64

Look for: "gain" (late - early TTFT) > 0 and growing with the prompt; "transfer exposed" (TTFT - the local
floor) for early well below late: with Nano-9B-v2 shapes and 2048-token chunks the KV of all chunks but the
last leaves during prefill (8K: ~36 % of the state's 263 MiB, 16K: ~57 % of 391 MiB; the fp32 SSM state,
final only after the last chunk, is the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

from hybridserve.deploy.launch import WorkerProcess, start_worker_process
from hybridserve.deploy.options import WorkerOptions
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.sampling_params import SamplingParams
from hybridserve.router.config import OrchestratorConfig
from hybridserve.router.orchestrator import Orchestrator
from hybridserve.transfer.planes import GRPC, TransferConfig

NANO_9B = Path(__file__).resolve().parent / "configs" / "nemotron-nano-9b-v2.json"
# the CPU smoke model: NemotronH in miniature (Mamba, attention, MLP, Mamba, attention)
TINY = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 5, "hybrid_override_pattern": "M*-M*",
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4,
        "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "expand": 2, "chunk_size": 16,
        "max_position_embeddings": 4096, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
MODES = ("local", "late", "early")


def _model_dir(device: str, config: str | None) -> Path:
    model = Path(tempfile.mkdtemp(prefix="hybridserve-early-send-"))
    if config is not None:
        shutil.copy(config, model / "config.json")
    elif device == "cuda":
        shutil.copy(NANO_9B, model / "config.json")
    else:
        (model / "config.json").write_text(json.dumps(TINY))
    return model


def _engine(args: argparse.Namespace) -> EngineConfig:
    cuda = args.device == "cuda"
    return EngineConfig(device=args.device, dtype="bfloat16" if cuda else "float32", load_format="dummy",
                        max_num_seqs=4, max_model_len=max(args.tokens) + 64, prefill_chunk_size=args.prefill_chunk_size,
                        gpu_memory_gb=args.gpu_memory_gb if cuda else None, cuda_graphs=cuda)


def _start(model: Path, engine: EngineConfig, log_dir: Path) -> dict[str, WorkerProcess]:
    """The decode worker and the two prefill workers, started in parallel (gRPC plane only)."""
    early, late = TransferConfig(planes=(GRPC,), grpc_early_send=True), TransferConfig(planes=(GRPC,))
    plan = {"decode": ("decode", early), "early": ("prefill", early), "late": ("prefill", late)}
    with futures.ThreadPoolExecutor(max_workers=3) as pool:
        started = {name: pool.submit(start_worker_process, role, f"{name}-worker",
                                     WorkerOptions(str(model), engine, transfer=transfer), log_dir=log_dir,
                                     verbose=True)
                   for name, (role, transfer) in plan.items()}
        return {name: f.result() for name, f in started.items()}


def _ttft(orchestrator: Orchestrator, prompt: list[int]) -> float:
    """Seconds from the call to the first token event (the request then runs to its end)."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first = None
    for event in orchestrator.generate(prompt, params):
        if first is None and event.token_ids:
            first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the request produced no token")
    return first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prefill-chunk-size", type=int, default=None, help="default: the engine's (2048 on CUDA)")
    parser.add_argument("--gpu-memory-gb", type=float, default=8.0, help="each worker's state-cache budget")
    parser.add_argument("--model-config", default=None, help="config.json (default: Nano-9B-v2 on CUDA, tiny on CPU)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<device>/early_send_ttft.json)")
    args = parser.parse_args(argv)
    out = Path(args.out or f"bench/results/{'gpu' if args.device == 'cuda' else 'cpu'}/early_send_ttft.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    model = _model_dir(args.device, args.model_config)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    engine = _engine(args)
    began = time.perf_counter()
    workers = _start(model, engine, out.parent / "early_send_logs")
    print(f"workers ready in {time.perf_counter() - began:.0f} s", flush=True)
    decode = workers["decode"].address
    orchestrators = {
        "local": Orchestrator([workers["late"].address], [decode], OrchestratorConfig(local_prefill_max_tokens=1 << 30),
                              subscribe_cache_events=False),
        "late": Orchestrator([workers["late"].address], [decode], subscribe_cache_events=False),
        "early": Orchestrator([workers["early"].address], [decode], subscribe_cache_events=False),
    }
    rng = random.Random(0)
    rows = []
    result = {"benchmark": "early_send_ttft", "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "grpcio": grpc.__version__, "cpu_count": os.cpu_count(),
              "prefill_chunk_tokens": engine.prefill_chunk_tokens,
              "model_config": json.loads((model / "config.json").read_text()),
              "modes": {"local": "decode worker prefills itself (no transfer): the floor",
                        "late": "P/D over gRPC, state sent after the first token",
                        "early": "P/D over gRPC, KV streamed as prefill chunks finish (grpc_early_send)"},
              "rows": rows}
    try:
        for tokens in args.tokens:
            for mode in MODES:  # warm-up: this length's step shapes compile / autotune on every worker
                _ttft(orchestrators[mode], [rng.randrange(3, vocab) for _ in range(tokens)])
            samples: dict[str, list[float]] = {mode: [] for mode in MODES}
            for _ in range(args.runs):
                for mode in MODES:
                    samples[mode].append(_ttft(orchestrators[mode], [rng.randrange(3, vocab) for _ in range(tokens)]))
            median = {mode: statistics.median(s) * 1e3 for mode, s in samples.items()}
            row = {"tokens": tokens, "runs": args.runs, **{f"ttft_ms_{m}": median[m] for m in MODES},
                   **{f"ttft_ms_{m}_all": [t * 1e3 for t in samples[m]] for m in MODES},
                   "gain_ms": median["late"] - median["early"],
                   "exposed_transfer_ms_late": median["late"] - median["local"],
                   "exposed_transfer_ms_early": median["early"] - median["local"]}
            rows.append(row)
            out.write_text(json.dumps(result, indent=2))
            print(f"{tokens:>6} tokens: TTFT median local {median['local']:8.1f} ms | late {median['late']:8.1f} ms "
                  f"| early {median['early']:8.1f} ms | gain {row['gain_ms']:7.1f} ms; transfer exposed: late "
                  f"{row['exposed_transfer_ms_late']:7.1f} ms, early {row['exposed_transfer_ms_early']:7.1f} ms",
                  flush=True)
    finally:
        for orchestrator in orchestrators.values():
            orchestrator.close()
        for worker in workers.values():
            worker.kill()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
