"""Decode step of a tensor-parallel engine, TP=1 vs TP=N side by side, against its floor.

Each engine (random weights of the config's shapes, `load_format="dummy"`; TP=N draws the same values as
TP=1, sliced) runs `batch` requests to their decode phase, then `LLMEngine.step()` is timed over decode-only
steps (the whole step: scheduler, broadcast to the follower ranks, forward, all-reduces, logits gather,
sampling). Floor of one step on rank 0:
  weight bytes of its shard (embedding rows aside) / measured device copy bandwidth
  + (layers + 1) all-reduces of [batch, hidden] at the all-reduce time measured for that size on the group.
Optionally (`--agreement N`) top-1 agreement TP=N vs TP=1: teacher-forced argmax over one N-token sequence
(keeps every engine alive; without it each engine is closed after its rows, so a model that fills one GPU at
TP=1 can be timed at TP=1 and then TP=2). `--cuda-graphs`: decode steps replay CUDA graphs (at TP > 1 the
graphs hold the NCCL all-reduces).

GPU (2 GPUs, ~3 min):  python bench/system/tp_decode.py --device cuda --dtype bfloat16 --tp 1 2 --batch 1 32 \
    --agreement 1000 --out tp_decode.json
Nemotron-H-56B shapes (H200 x2, ~6 min; TP=1 holds 113 GB of weights on one H200, drop `1` on 80 GB GPUs):
    python bench/system/tp_decode.py --config bench/configs/nemotron-h-56b-base-8k.json --device cuda \
    --dtype bfloat16 --tp 1 2 --batch 1 32 --steps 30 --cuda-graphs --out tp_decode_56b.json
  (shapes: 118 layers "M-M-M-M*-...", 54 Mamba-2 / 54 MLP / 10 attention, hidden 8192, FFN 32768, 64 query / 8 KV
  heads of 128, 256 Mamba heads of 64, state 256, 8 groups, vocab 131072: NVIDIA's model card and the
  Megatron-Bridge NemotronHModelProvider56B; the config.json file itself was not reachable here)
Trained weights, top-1:  python bench/system/tp_decode.py --device cuda --dtype bfloat16 --model models/demo_model \
    --batch 1 --agreement 1000
CPU smoke:             python bench/system/tp_decode.py --config <tiny config dir> --device cpu --steps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.llm_engine import LLMEngine

NANO_9B = Path(__file__).resolve().parents[1] / "configs" / "nemotron-nano-9b-v2.json"
PROMPT = 64  # tokens of context before the timed decode steps


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int, repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of `repeats`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times[2:])


def _probe_rank(rank: int, size: int, init: str, device: str, sizes: list[int], repeats: int, out: Any) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init, rank=rank, world_size=size)
    result = {}
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 2), dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                            device=device if device != "cuda" else f"cuda:{rank}")
        times = []
        for _ in range(repeats + 3):
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            _sync(device)
            times.append(time.perf_counter() - start)
        result[nbytes] = statistics.median(times[3:])
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def allreduce_seconds(size: int, device: str, sizes: list[int], repeats: int) -> dict[int, float]:
    """Median all-reduce time per message size (bytes) on a fresh group of `size` ranks on this host."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    procs = [context.Process(target=_probe_rank, args=(r, size, init, device, sizes, repeats, queue))
             for r in range(size)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return result


def shard_weight_bytes(engine: LLMEngine) -> int:
    model = getattr(engine.model, "model", engine.model)  # rank 0's HybridLM under the TP proxy
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - model.embeddings.weight.numel() * model.embeddings.weight.element_size()


def decode_step_ms(engine: LLMEngine, batch: int, steps: int, device: str) -> float:
    """Median wall time of a decode-only `step()` with `batch` running requests."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=PROMPT + steps + 16, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([(7 * i + j) % (vocab - 3) + 3 for j in range(PROMPT)], params) for i in range(batch)]
    while any(r.num_computed_tokens < PROMPT for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort(request_id)
    return 1000 * statistics.median(times)


def agreement(engines: dict[int, LLMEngine], tokens: int) -> float:
    """Teacher-forced top-1 agreement of every TP size with TP=1 over one `tokens`-long greedy sequence."""
    base = engines[1]
    prompt = [3 + i % 50 for i in range(16)]
    request = base.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    sequence = None
    while base.has_unfinished():
        for out in base.step():
            if out.request_id == request and out.finished:
                sequence = prompt + out.token_ids
    assert sequence is not None
    reference = base.prompt_logits(sequence[:-1]).argmax(-1)
    return min(float((e.prompt_logits(sequence[:-1]).argmax(-1) == reference).float().mean())
               for tp, e in engines.items() if tp != 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=NANO_9B, help="config.json, or a directory holding one")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--agreement", type=int, default=0, help="tokens of the TP-vs-TP=1 top-1 check (0: off)")
    parser.add_argument("--model", type=Path, help="a checkpoint directory: its weights instead of dummy ones "
                        "(e.g. models/demo_model for a trained model's top-1 agreement)")
    parser.add_argument("--cuda-graphs", action="store_true", help="replay decode steps from CUDA graphs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.model is not None:
        model_dir, config_file = args.model, args.model / "config.json"
    else:
        model_dir = Path(tempfile.mkdtemp(prefix="tp-decode-"))
        config_file = args.config / "config.json" if args.config.is_dir() else args.config
        shutil.copy(config_file, model_dir / "config.json")
    hidden = json.loads(config_file.read_text())["hidden_size"]
    elsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    bandwidth = copy_bandwidth(args.device, 1 << (30 if args.device == "cuda" else 24), 20)
    sizes = sorted({b * hidden * elsize for b in args.batch})
    collectives = {tp: allreduce_seconds(tp, args.device, sizes, 200 if args.device == "cuda" else 5)
                   for tp in args.tp if tp > 1}
    rows, engines = [], {}
    for tp in args.tp:
        engine = LLMEngine(model_dir, EngineConfig(
            device=args.device, dtype=args.dtype, tensor_parallel_size=tp,
            load_format="dummy" if args.model is None else "safetensors",
            max_num_seqs=max(args.batch), max_model_len=PROMPT + args.steps + args.agreement + 64,
            enable_prefix_caching=False, cuda_graphs=args.cuda_graphs, warmup=False,
            gpu_memory_gb=4.0 if args.device == "cuda" else None))  # the engines share GPU 0
        weights = shard_weight_bytes(engine)
        layers = engine.model_config.num_layers
        for batch in args.batch:
            step = decode_step_ms(engine, batch, args.steps, args.device)
            comm = (layers + 1) * collectives[tp][batch * hidden * elsize] if tp > 1 else 0.0
            floor = 1000 * (weights / bandwidth + comm)
            rows.append(dict(tp=tp, batch=batch, step_ms=step, floor_ms=floor, weights_gb=weights / 1e9,
                             allreduce_ms=1000 * comm, step_over_floor=step / floor))
            print(f"TP={tp} batch={batch:3d}  step {step:8.3f} ms  floor {floor:8.3f} ms "
                  f"(weights {weights / 1e9:.2f} GB, all-reduce {1000 * comm:.3f} ms)  x{step / floor:.2f}")
        if args.agreement:
            engines[tp] = engine
        else:  # free this size's GPU memory before the next one loads
            engine.close()
            del engine
            gc.collect()  # graphs and the proxy's references form cycles
            if args.device == "cuda":
                torch.cuda.empty_cache()
    base = {r["batch"]: r["step_ms"] for r in rows if r["tp"] == 1}
    for r in rows:
        r["vs_tp1"] = r["step_ms"] / base[r["batch"]] if r["batch"] in base else None
    top1 = agreement(engines, args.agreement) if args.agreement and 1 in engines and len(engines) > 1 else None
    if top1 is not None:
        print(f"top-1 agreement TP>1 vs TP=1 over {args.agreement} tokens: {100 * top1:.2f} %")
    for engine in engines.values():
        engine.close()
    result = dict(
        device=torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, config=str(config_file), dtype=args.dtype, steps=args.steps,
        cuda_graphs=args.cuda_graphs, nccl=".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
        copy_bandwidth_gbs=bandwidth / 1e9,
        allreduce_us={str(tp): {str(k): 1e6 * v for k, v in t.items()} for tp, t in collectives.items()},
        rows=rows, top1_agreement=top1,
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
