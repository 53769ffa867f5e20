"""TTFT of long prompts with the gRPC state transfer overlapped with prefill (`grpc_early_send`) vs not.

One decode worker and one prefill worker per P/D mode as plain processes (no Ray), all on one device, every
transfer over the gRPC plane (the only plane besides NIXL the overlap helps):
  late   : the whole state is sent after the first token;
  chunks : the KV of each finished prefill chunk streams while later chunks compute, the rest (the KV of the last
           chunk, every Mamba layer's SSM state / conv window, hidden) after the last chunk's forward
           (`grpc_layer_send` off);
  early  : as chunks, and in the last chunk's forward the KV rest leaves once the last attention layer ran and
           each Mamba layer's state once that layer ran (`grpc_layer_send`, the default);
  local  : the floor from the same run: the decode worker prefilling the prompt itself (no transfer).
Each request is timed from the orchestrator's call to its first token event (what a client sees as TTFT);
fresh random prompts every run (no prefix-cache hits), modes interleaved, median of --runs after a warm-up.

  GPU (H200, 4 workers): python bench/early_send_ttft.py --device cuda --tokens 8192 16384 --runs 5  (~3-4 min)
  GPU (H100, 3 workers): add --modes local chunks early
  CPU smoke: python bench/early_send_ttft.py --device cpu --tokens 256 512 --runs 2 --prefill-chunk-size 64

Look for: "gain" (late - early TTFT) > 0 and growing with the prompt; "transfer exposed" (TTFT - the local
floor) for early well below late. With Nano-9B-v2 shapes and 2048-token chunks the KV of all chunks but the
last leaves during earlier chunks (8K: ~36 % of the state's 263 MiB, 16K: ~57 % of 391 MiB). "layer_gain"
(chunks - early) > 0: the layer path also sends the fp32 SSM states (~135 MiB) during the last chunk's forward,
layer i's right after layer i (the early layout puts the last chunk's KV rows behind them), so what is left
after the forward is about (135 MiB - what the pipe moved during the forward) + that chunk's 32 MiB of KV;
expect layer_gain up to the last chunk's forward time (tens of ms at 2048 tokens) where gRPC is the bottleneck.
Check the prefill worker's INFO lines ("... MiB handed to the streams before the last prefill step staged the
rest": with the layer path most of the SSM state is in it) and whether the prefill itself got slower: on one
H200 the chunk path's send threads took the GIL from the engine loop and ate its gain
(bench/results/h200/early_send/); the layer path sends during the last forward, so it can suffer the same.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.deploy.launch import WorkerProcess, start_worker_process
from hybridserve.deploy.options import WorkerOptions
from hybridserve.engine.config import EngineConfig
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
MODES = ("local", "late", "chunks", "early")
TRANSFERS = {"late": TransferConfig(planes=(GRPC,), grpc_early_send=False),
             "chunks": TransferConfig(planes=(GRPC,), grpc_early_send=True, grpc_layer_send=False),
             "early": TransferConfig(planes=(GRPC,), grpc_early_send=True, grpc_layer_send=True)}


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


def _start(model: Path, engine: EngineConfig, log_dir: Path, modes: list[str],
           chunk_bytes: int | None = None) -> dict[str, WorkerProcess]:
    """The decode worker and a prefill worker per P/D mode, started in parallel (gRPC plane only)."""
    transfers = {mode: t if chunk_bytes is None else dataclasses.replace(t, grpc_chunk_bytes=chunk_bytes)
                 for mode, t in TRANSFERS.items()}
    plan = {"decode": ("decode", transfers["early"]),
            **{mode: ("prefill", transfers[mode]) for mode in modes if mode in transfers}}
    with futures.ThreadPoolExecutor(max_workers=len(plan)) as pool:
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
    parser.add_argument("--grpc-chunk-bytes", type=int, default=None,
                        help="gRPC message payload size of every worker (default: TransferConfig's)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="what to time (each P/D mode starts its own prefill worker on the device)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/<device>/early_send_ttft.json)")
    args = parser.parse_args(argv)
    modes = [mode for mode in MODES if mode in args.modes]
    if not any(mode in TRANSFERS for mode in modes):
        parser.error("--modes needs at least one of late, chunks, early (local prefill needs a prefill worker too)")
    out = Path(args.out or f"bench/results/{'gpu' if args.device == 'cuda' else 'cpu'}/early_send_ttft.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    model = _model_dir(args.device, args.model_config)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    engine = _engine(args)
    began = time.perf_counter()
    workers = _start(model, engine, out.parent / "early_send_logs", modes, args.grpc_chunk_bytes)
    print(f"workers ready in {time.perf_counter() - began:.0f} s", flush=True)
    decode = workers["decode"].address
    any_prefill = next(workers[mode].address for mode in modes if mode in TRANSFERS)
    orchestrators = {mode: Orchestrator([workers[mode].address], [decode], subscribe_cache_events=False)
                     for mode in modes if mode in TRANSFERS}
    if "local" in modes:
        orchestrators["local"] = Orchestrator([any_prefill], [decode], OrchestratorConfig(local_prefill_max_tokens=1 << 30),
                                              subscribe_cache_events=False)
    rng = random.Random(0)
    rows = []
    result = {"benchmark": "early_send_ttft", "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "grpcio": grpc.__version__, "cpu_count": os.cpu_count(),
              "prefill_chunk_tokens": engine.prefill_chunk_tokens,
              "model_config": json.loads((model / "config.json").read_text()),
              "modes": {m: d for m, d in {
                  "local": "decode worker prefills itself (no transfer): the floor",
                  "late": "P/D over gRPC, state sent after the first token",
                  "chunks": "P/D over gRPC, KV streamed as prefill chunks finish (grpc_early_send, no grpc_layer_send)",
                  "early": "P/D over gRPC, KV streamed as chunks finish and the last chunk's state layer by layer "
                           "(grpc_early_send + grpc_layer_send)"}.items() if m in modes},
              "rows": rows}
    try:
        for tokens in args.tokens:
            for mode in modes:  # warm-up: this length's step shapes compile / autotune on every worker
                _ttft(orchestrators[mode], [rng.randrange(3, vocab) for _ in range(tokens)])
            samples: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(args.runs):
                for mode in modes:
                    samples[mode].append(_ttft(orchestrators[mode], [rng.randrange(3, vocab) for _ in range(tokens)]))
            median = {mode: statistics.median(s) * 1e3 for mode, s in samples.items()}
            row = {"tokens": tokens, "runs": args.runs, **{f"ttft_ms_{m}": median[m] for m in modes},
                   **{f"ttft_ms_{m}_all": [t * 1e3 for t in samples[m]] for m in modes}}
            if "late" in median and "early" in median:
                row["gain_ms"] = median["late"] - median["early"]
            if "chunks" in median and "early" in median:
                row["layer_gain_ms"] = median["chunks"] - median["early"]  # what the layer path adds
            if "local" in median:
                row.update({f"exposed_transfer_ms_{m}": median[m] - median["local"] for m in modes if m != "local"})
            rows.append(row)
            out.write_text(json.dumps(result, indent=2))
            figures = " | ".join(f"{m} {median[m]:8.1f} ms" for m in modes)
            gains = "; ".join(f"{k} {v:7.1f} ms" for k, v in row.items() if k.endswith("gain_ms") or k.startswith("exposed"))
            print(f"{tokens:>6} tokens: TTFT median {figures}; {gains}", flush=True)
    finally:
        for orchestrator in orchestrators.values():
            orchestrator.close()
        for worker in workers.values():
            worker.kill()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
