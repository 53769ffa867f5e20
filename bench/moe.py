"""MoE layer and whole-model decode step of Nemotron-3-Nano-30B-A3B shapes (bench/configs/, dummy weights) beside
their floors, with the device's copy bandwidth and bf16 matmul peak measured in the same run.

MoE layer (router + routed experts + shared expert), timed as CUDA-graph replays (median of many), and its expert
GEMMs alone (`experts_*`: the routed experts, plus the shared expert where it runs inside the fused GEMMs):
  decode batch 1 / 8 / 32 / 128: floor = bytes the layer must read (the distinct experts the batch routes to,
  the shared expert, the router) / copy bandwidth;  prefill 4096 tokens: floor = flops / bf16 matmul peak, and
  the routed expert GEMMs' own TFLOP/s as a share of that peak. fp8 experts (weight-only) get their own rows.
Whole model, decode batch 1 with 512 tokens of context, captured as one CUDA graph: floor = the weights the step
reads (every dense weight, the active experts of every MoE layer, lm_head; not the embedding table) plus the
Mamba state read + written, over copy bandwidth.

GPU:  source .whl/setup.sh && python bench/moe.py --device cuda --out $OUT/moe.json
CPU smoke run (tiny shapes, plain timing): python bench/moe.py --device cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sections import run_sections, write_json  # noqa: E402

from hybridserve.models.config import ModelConfig, MoEConfig  # noqa: E402
from hybridserve.models.forward_batch import ForwardBatch  # noqa: E402
from hybridserve.models.moe import MoE  # noqa: E402
from hybridserve.models.weights import dummy_model  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "nemotron-3-nano-30b-a3b.json"
DECODE_BATCHES = (1, 8, 32, 128)
PREFILL_TOKENS = 4096
CONTEXT, PAGE = 512, 16
TINY = dict(hidden_size=64, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_routed_experts=8,
            num_experts_per_tok=2, vocab_size=256, hybrid_override_pattern="MEM*E", num_hidden_layers=5,
            mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


class Timer:
    """Median wall time of a callable: CUDA graphs + triton's do_bench on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, quick: bool) -> None:
        self.device, self.quick = device, quick

    def __call__(self, fn: Callable[[], Any], graph: bool = True) -> float:
        if self.device.type == "cuda":
            from cuda_graph import capture
            from triton.testing import do_bench

            run = capture(fn).replay if graph else fn
            return float(do_bench(run, warmup=10 if self.quick else 50, rep=50 if self.quick else 300,
                                  return_mode="median"))
        fn()
        times = []
        for _ in range(3 if self.quick else 10):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


def ceilings(device: torch.device, timer: Timer, big: bool) -> dict[str, float]:
    """Copy GB/s (read + write) and dense bf16 matmul TFLOP/s of this device."""
    n, m = (1 << 28, 8192) if big else (1 << 22, 512)
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    copy_ms = timer(lambda: dst.copy_(src), graph=False)
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_ms = timer(lambda: a @ b, graph=False)
    return {"copy_GBps": 2 * n * 4 / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * m**3 / mm_ms / 1e9}


def moe_layer(config: ModelConfig, device: torch.device, fp8: bool) -> MoE:
    """One MoE block with dummy bf16 (or fp8) weights: router N(0, 0.02) routes nearly uniformly."""
    assert config.moe is not None
    moe_config = dataclasses.replace(config.moe, fp8_experts=fp8)
    small = dataclasses.replace(config, layer_types=("moe",), moe=moe_config, mtp_layer_types=())
    return dummy_model(small, torch.bfloat16, device).layers[0].mixer


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()] if t is not None)


def bench_layer(config: ModelConfig, device: torch.device, timer: Timer, ceil: dict, fp8: bool,
                batches: tuple[int, ...], prefill: int) -> list[dict]:
    moe_cfg: MoEConfig = config.moe  # type: ignore[assignment]
    layer = moe_layer(config, device, fp8)
    experts = layer.experts
    per_expert = (experts.up_proj[0].numel() + experts.down_proj[0].numel()) * experts.up_proj.element_size()
    dense_bytes = _bytes(layer) - _bytes(experts)  # router, shared expert, latent projections
    hidden, inter, k = config.hidden_size, moe_cfg.intermediate_size, moe_cfg.experts_per_token
    expert_in = moe_cfg.latent_size or hidden
    # with the shared expert fused (bf16 Nano: two 1856-row chunks), the experts call runs it as well
    shared = layer.shared_experts if layer.shared_chunks else None
    shared_bytes = _bytes(layer.shared_experts) if shared is not None else 0
    shared_flops = 2 * 2 * hidden * moe_cfg.shared_intermediate_size if shared is not None else 0  # per token
    rows = []
    for tokens in (*batches, prefill):
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            weights, ids = layer.gate(x)
            latent = layer.fc1_latent_proj(x)
        active = int(torch.unique(ids[:, :k]).numel())  # routed experts hit; outside the timed region
        routed_flops = 2 * tokens * k * 2 * expert_in * inter
        flops = routed_flops + 2 * tokens * (2 * hidden * moe_cfg.shared_intermediate_size + hidden * moe_cfg.num_experts)
        read = active * per_expert + dense_bytes
        floor_ms = max(read / ceil["copy_GBps"] / 1e6, flops / ceil["bf16_matmul_TFLOPs"] / 1e9)
        with torch.no_grad():
            layer_ms = timer(lambda: layer(x))
            experts_ms = timer(lambda: experts(latent, weights, ids, shared=shared))
        experts_floor = max((active * per_expert + shared_bytes) / ceil["copy_GBps"] / 1e6,
                            (routed_flops + tokens * shared_flops) / ceil["bf16_matmul_TFLOPs"] / 1e9)
        row = {"tokens": tokens, "phase": "prefill" if tokens == prefill else "decode",
               "experts": "fp8" if fp8 else "bf16", "active_experts": active, "read_MB": read / 1e6,
               "GFLOP": flops / 1e9, "layer_ms": layer_ms, "floor_ms": floor_ms, "layer_over_floor": layer_ms / floor_ms,
               "shared_fused": shared is not None, "experts_ms": experts_ms, "experts_floor_ms": experts_floor,
               "experts_over_floor": experts_ms / experts_floor,
               "experts_TFLOPs": (routed_flops + tokens * shared_flops) / experts_ms / 1e9,
               "experts_pct_of_matmul_peak": 100 * (routed_flops + tokens * shared_flops) / experts_ms / 1e9
               / ceil["bf16_matmul_TFLOPs"]}
        rows.append(row)
        print("moe " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
    return rows


def bench_model_step(config: ModelConfig, device: torch.device, timer: Timer, ceil: dict) -> dict:
    """Decode step (forward of one token + lm_head) at batch 1 as one CUDA graph, vs its weight + state floor."""
    from hybridserve.statepool.state_cache import CacheLayout, StateCache

    model = dummy_model(config, torch.bfloat16, device)
    assert config.moe is not None and config.mamba is not None
    pages = CONTEXT // PAGE + 1
    layout = CacheLayout(num_pages=pages, page_size=PAGE, num_slots=1, conv_width=config.mamba.conv_kernel - 1)
    cache = StateCache(config, layout, torch.bfloat16, torch.float32, device)
    tables = torch.arange(pages, device=device).view(1, pages)
    batch = ForwardBatch(num_decode=1, query_lens=(1,), cu_seqlens=torch.arange(2, device=device),
                         context_lens=torch.full((1,), CONTEXT, device=device),
                         kv_lens=torch.full((1,), CONTEXT + 1, device=device),
                         state_slots=torch.zeros(1, dtype=torch.int64, device=device), block_tables=tables,
                         slot_mapping=tables[:, CONTEXT // PAGE] * PAGE + CONTEXT % PAGE)
    ids = torch.randint(0, config.vocab_size, (1,), device=device)

    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, batch, cache))

    experts = [m.mixer.experts for m in model.layers if m.kind == "moe"]
    expert_bytes = sum(_bytes(e) for e in experts)
    per_expert = [(e.up_proj[0].numel() + e.down_proj[0].numel()) * e.up_proj.element_size() for e in experts]
    weight_bytes = _bytes(model) - expert_bytes - _bytes(model.embeddings)
    active_bytes = sum(p * config.moe.experts_per_token for p in per_expert)  # batch 1: k distinct experts
    state_bytes = 2 * sum(t.numel() * t.element_size() for t in (cache.ssm_states[0], cache.conv_states[0]))
    state_bytes *= len(config.layers_of("mamba"))
    floor_ms = (weight_bytes + active_bytes + state_bytes) / ceil["copy_GBps"] / 1e6
    row: dict[str, Any] = {"batch": 1, "context": CONTEXT, "dense_weight_GB": weight_bytes / 1e9,
                           "active_expert_GB": active_bytes / 1e9, "state_GB": state_bytes / 1e9, "floor_ms": floor_ms}
    with torch.no_grad():
        row["eager_ms"] = timer(step, graph=False)
        try:
            row["graph_ms"] = timer(step)
            row["graph_over_floor"] = row["graph_ms"] / floor_ms
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured is the finding
            row["graph_error"] = repr(exc)[:500]
    print("step " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    parser.add_argument("--skip", nargs="*", default=[], help="sections to skip: layer fp8 step")
    args = parser.parse_args()
    device = torch.device(args.device)
    data = json.loads(args.config.read_text())
    cpu = device.type == "cpu"
    if cpu:  # smoke run: tiny shapes, same code path
        data.update(TINY)
    config = ModelConfig.from_hf_dict(data)
    timer = Timer(device, args.quick or cpu)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if not cpu else "cpu",
                              "torch": torch.__version__, "config": args.config.name, "tiny": cpu}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    result["ceilings"] = ceil = ceilings(device, timer, big=not cpu)
    print(f"{result['device']}: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.1f} TFLOP/s",
          flush=True)
    batches, prefill = (DECODE_BATCHES, PREFILL_TOKENS) if not cpu else ((1, 4), 64)
    sections: dict[str, Callable[[], Any]] = {
        "layer": lambda: bench_layer(config, device, timer, ceil, False, batches, prefill),
        "fp8": lambda: bench_layer(config, device, timer, ceil, True, batches[:3], prefill),
        "step": lambda: bench_model_step(config, device, timer, ceil),
    }
    run_sections(sections, args.skip, result)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
