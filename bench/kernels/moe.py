"""MoE layer and whole-model decode step of Nemotron-3-Nano-30B-A3B shapes (bench/configs/, dummy weights) beside
their floors, with the device's copy bandwidth and bf16 matmul peak measured in the same run.

Timing: triton's do_bench median (CUDA events around each run, L2 flushed before each, warm-up first) of
CUDA-graph replays; the decode layer's graph runs LAYER_COPIES distinct copies of the layer back to back (as a
model's layers run; the graph's own launch is spread over them), the time is per layer.
  decode 1 / 8 / 16 / 32 / 128 tokens, the layer (router + routed experts + shared expert) through both Triton paths:
  `grouped` (alignment + grouped GEMMs + combine) and `small` (the small-M path: logits, up, down), and the
  `default` dispatch (SMALL_M_MAX_PAIRS); floor = bytes the layer must read (the distinct routed experts, the
  shared expert, the router) / copy bandwidth.
  prefill 4096 tokens (--prefill-tokens): the expert GEMMs' TFLOP/s beside torch.mm of the same shapes in this
  run (the up and down projections of every (token, expert) pair as one dense [pairs, D] x [D, I] and [pairs, I] x
  [I, D]) and beside the square 8192^3 bf16 peak; the autotuner's chosen tiles are recorded. fp8 experts get rows
  too: weight-only (bf16 activations) and W8A8 (`fp8_activations`: both GEMMs fp8 x fp8, the row quantizations
  included).
Whole model, decode batch 1 with 512 tokens of context, captured as one CUDA graph (default dispatch and with the
small path off): floor = the weights the step reads (every dense weight, the active experts of every MoE layer,
lm_head; not the embedding table) plus the Mamba state read + written, over copy bandwidth (the KV cache read,
~3 MB, is left out).

GPU (one H200; a cold Triton cache spends most of the time compiling and autotuning; `wall_s` in the JSON):
  source .whl/setup.sh && python bench/kernels/moe.py --device cuda --skip fp8_decode fp8_prefill --out $OUT/moe.json
  source .whl/setup.sh && python bench/kernels/moe.py --device cuda --skip decode prefill step --out $OUT/moe_fp8.json
  the layer at chosen token counts only: ... --skip prefill fp8_decode fp8_prefill step --decode-tokens 1 2
CPU smoke run (tiny shapes, the torch reference, plain timing): python bench/kernels/moe.py --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sections import run_sections, write_json  # noqa: E402

from hybridserve.common.model_config import ModelConfig, MoEConfig  # noqa: E402
from hybridserve.models.forward_batch import ForwardBatch  # noqa: E402
from hybridserve.models.moe import MoE  # noqa: E402
from hybridserve.models.weights import dummy_model  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "nemotron-3-nano-30b-a3b.json"
DECODE_BATCHES = (1, 8, 16, 32, 128)
PREFILL_TOKENS = 4096
PREFILL_BLOCK_M = (64, 128)  # grouped-GEMM row blocks measured at prefill (the default picks 128 at 4K tokens)
LAYER_COPIES = 4  # distinct decode-layer copies per graph (2.6 GB each at Nano's shapes)
CONTEXT, PAGE = 512, 16
PATHS = {"grouped": 0, "small": 1 << 30, "default": None}  # small_max_pairs per measured path
TINY = dict(hidden_size=64, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_routed_experts=8,
            num_experts_per_tok=2, vocab_size=256, hybrid_override_pattern="MEM*E", num_hidden_layers=5,
            mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


class Timer:
    """Median time of a callable: CUDA graphs + triton's do_bench on the GPU, perf_counter on the CPU."""

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
    """Copy GB/s (read + write) and dense square bf16 matmul TFLOP/s of this device."""
    n, m = (1 << 28, 8192) if big else (1 << 22, 512)
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    copy_ms = timer(lambda: dst.copy_(src), graph=False)
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_ms = timer(lambda: a @ b, graph=False)
    return {"copy_GBps": 2 * n * 4 / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * m**3 / mm_ms / 1e9}


def moe_layer(config: ModelConfig, device: torch.device, fp8: bool, seed: int = 0) -> MoE:
    """One MoE block with dummy bf16 (or fp8) weights: router N(0, 0.02) routes nearly uniformly."""
    assert config.moe is not None
    moe_config = dataclasses.replace(config.moe, fp8_experts=fp8)
    small = dataclasses.replace(config, layer_types=("moe",), moe=moe_config, mtp_layer_types=())
    return dummy_model(small, torch.bfloat16, device, seed=seed).layers[0].mixer


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()] if t is not None)


def _fmt(prefix: str, row: dict) -> str:
    return prefix + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def bench_decode(config: ModelConfig, device: torch.device, timer: Timer, ceil: dict, fp8: bool,
                 batches: tuple[int, ...], copies: int) -> list[dict]:
    """The layer at decode sizes through each path, per layer of `copies` distinct layers in one graph."""
    moe_cfg: MoEConfig = config.moe  # type: ignore[assignment]
    layers = [moe_layer(config, device, fp8, seed=i) for i in range(copies)]
    experts = layers[0].experts
    per_expert = (experts.up_proj[0].numel() + experts.down_proj[0].numel()) * experts.up_proj.element_size()
    dense_bytes = _bytes(layers[0]) - _bytes(experts)  # router, shared expert, latent projections
    rows = []
    for tokens in batches:
        x = torch.randn(tokens, config.hidden_size, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            _, ids = layers[0].gate(x)
        active = int(torch.unique(ids[:, :moe_cfg.experts_per_token]).numel())  # outside the timed region
        floor_ms = (active * per_expert + dense_bytes) / ceil["copy_GBps"] / 1e6
        row: dict[str, Any] = {"tokens": tokens, "experts": "fp8" if fp8 else "bf16", "active_experts": active,
                               "read_MB": (active * per_expert + dense_bytes) / 1e6, "floor_ms": floor_ms,
                               "shared_fused": layers[0].shared_chunks > 0}
        for path, limit in PATHS.items():
            def run(limit: int | None = limit) -> None:
                for layer in layers:
                    layer(x, small_max_pairs=limit)

            with torch.no_grad():
                row[f"{path}_ms"] = timer(run) / copies
            row[f"{path}_over_floor"] = row[f"{path}_ms"] / floor_ms
        rows.append(row)
        print(_fmt("decode ", row), flush=True)
    return rows


def _best_configs(kernel: Any) -> dict[str, str]:
    """The autotuner's choice per key (empty on the CPU)."""
    return {str(key): str(config) for key, config in getattr(kernel, "cache", {}).items()}


def bench_prefill(config: ModelConfig, device: torch.device, timer: Timer, ceil: dict, fp8: bool,
                  tokens: int) -> dict:
    """Expert GEMMs (and the layer) at a prefill of `tokens`, beside torch.mm of the same GEMM shapes."""
    moe_cfg: MoEConfig = config.moe  # type: ignore[assignment]
    layer = moe_layer(config, device, fp8)
    experts, hidden, inter = layer.experts, config.hidden_size, moe_cfg.intermediate_size
    shared = layer.shared_experts if layer.shared_chunks else None  # bf16 Nano: two 1856-row chunks, fused
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        weights, ids = layer.gate(x)
        latent = layer.fc1_latent_proj(x)
        expert_in = latent.shape[1]
        layer_ms = timer(lambda: layer(x))
        experts_ms = timer(lambda: experts(latent, weights, ids, shared=shared))
    pairs = ids.numel()  # routed (+ shared chunk) pairs the GEMMs run
    flops = 2 * pairs * 2 * expert_in * inter
    a_up = torch.randn(pairs, expert_in, device=device, dtype=torch.bfloat16)
    b_up = torch.randn(expert_in, inter, device=device, dtype=torch.bfloat16)
    a_down = torch.randn(pairs, inter, device=device, dtype=torch.bfloat16)
    b_down = torch.randn(inter, expert_in, device=device, dtype=torch.bfloat16)
    mm_ms = timer(lambda: torch.mm(a_up, b_up), graph=False) + timer(lambda: torch.mm(a_down, b_down), graph=False)
    row: dict[str, Any] = {
        "tokens": tokens, "experts": "fp8" if fp8 else "bf16", "pairs": pairs, "shared_fused": shared is not None,
        "GFLOP": flops / 1e9, "layer_ms": layer_ms, "experts_ms": experts_ms, "same_shape_mm_ms": mm_ms,
        "experts_TFLOPs": flops / experts_ms / 1e9, "same_shape_mm_TFLOPs": flops / mm_ms / 1e9,
        "experts_pct_of_same_shape_mm": 100 * mm_ms / experts_ms,
        "experts_pct_of_square_peak": 100 * flops / experts_ms / 1e9 / ceil["bf16_matmul_TFLOPs"]}
    if device.type == "cuda":  # the row-block height is chosen before the alignment: each one measured
        from hybridserve.kernels.moe_triton import _moe_gemm_kernel, moe_experts_triton

        shared_w = (shared.up_proj.weight, shared.down_proj.weight) if shared is not None else (None, None)
        # fp8 experts also run W8A8: both GEMMs fp8 x fp8, the two row quantizations included
        for block_m, a8 in [(m, a8) for a8 in ((False, True) if fp8 else (False,)) for m in PREFILL_BLOCK_M]:
            with torch.no_grad():
                ms = timer(lambda bm=block_m, a8=a8: moe_experts_triton(
                    latent, experts.up_proj, experts.down_proj, weights, ids, experts.up_proj_scale,
                    experts.down_proj_scale, None, *shared_w, block_m=bm, fp8_activations=a8))
            if a8:
                row[f"experts_a8_ms_block_m{block_m}"] = ms
                row[f"experts_a8_TFLOPs_block_m{block_m}"] = flops / ms / 1e9
            else:
                row[f"experts_ms_block_m{block_m}"] = ms
                row[f"experts_pct_of_same_shape_mm_block_m{block_m}"] = 100 * mm_ms / ms
        row["gemm_configs"] = _best_configs(_moe_gemm_kernel)
    print(_fmt("prefill ", {k: v for k, v in row.items() if k != "gemm_configs"}), flush=True)
    return row


@contextlib.contextmanager
def _small_m_limit(device: torch.device, limit: int | None) -> Iterator[None]:
    """Benchmark-only switch of the Triton dispatch threshold for a whole model (None: as it is; CPU: no-op)."""
    if limit is None or device.type != "cuda":
        yield
        return
    from hybridserve.kernels import moe_small_triton

    default = moe_small_triton.SMALL_M_MAX_PAIRS
    moe_small_triton.SMALL_M_MAX_PAIRS = limit
    try:
        yield
    finally:
        moe_small_triton.SMALL_M_MAX_PAIRS = default


def bench_model_step(config: ModelConfig, device: torch.device, timer: Timer, ceil: dict) -> dict:
    """Decode step (forward of one token + lm_head) at batch 1 as one CUDA graph, vs its weight + state floor;
    with the default dispatch (the small-M path) and with the small path off (the grouped GEMMs)."""
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
    # slot 0's conv + ssm state of every Mamba layer ([slot, layer, ...]), read and written once
    state_bytes = 2 * sum(t[0].numel() * t.element_size() for t in (cache.ssm_states, cache.conv_states))
    floor_ms = (weight_bytes + active_bytes + state_bytes) / ceil["copy_GBps"] / 1e6
    row: dict[str, Any] = {"batch": 1, "context": CONTEXT, "moe_layers": len(experts), "dense_weight_GB": weight_bytes / 1e9,
                           "active_expert_GB": active_bytes / 1e9, "state_GB": state_bytes / 1e9, "floor_ms": floor_ms}
    with torch.no_grad():
        row["eager_ms"] = timer(step, graph=False)
        for name, limit in (("graph", None), ("graph_grouped_only", 0)):
            try:
                with _small_m_limit(device, limit):
                    row[f"{name}_ms"] = timer(step)
                row[f"{name}_over_floor"] = row[f"{name}_ms"] / floor_ms
            except Exception as exc:  # noqa: BLE001 - a step that cannot be captured is the finding
                row[f"{name}_error"] = repr(exc)[:500]
    print(_fmt("step ", row), flush=True)
    return row


def summary(result: dict[str, Any]) -> list[str]:
    """Markdown tables of the headline numbers (also stored under result["summary"])."""
    lines = []
    for section in ("decode", "fp8_decode"):
        rows = result.get(section)
        if not isinstance(rows, list):
            continue
        lines += [f"| {section} tokens | floor us | grouped us (x floor) | small us (x floor) | default us (x floor) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['tokens']} | {1e3 * r['floor_ms']:.1f} | " + " | ".join(
            f"{1e3 * r[p + '_ms']:.1f} ({r[p + '_over_floor']:.2f}x)" for p in ("grouped", "small", "default")) + " |"
            for r in rows]
        faster = [r["tokens"] for r in rows if r["small_ms"] < r["grouped_ms"]]
        lines.append(f"small path faster at tokens {faster}")
    for section in ("prefill", "fp8_prefill"):
        for r in result.get(section) or []:
            if not isinstance(r, dict) or "experts_ms" not in r:
                continue
            lines.append(f"{section} {r['tokens']} tokens: expert GEMMs {r['experts_ms']:.3f} ms = "
                         f"{r['experts_TFLOPs']:.0f} TFLOP/s, {r['experts_pct_of_same_shape_mm']:.0f} % of torch.mm of "
                         f"the same shapes ({r['same_shape_mm_TFLOPs']:.0f} TFLOP/s), "
                         f"{r['experts_pct_of_square_peak']:.0f} % of the square bf16 peak; layer {r['layer_ms']:.3f} ms"
                         + "".join(f"; block_m {m}: {r[f'experts_pct_of_same_shape_mm_block_m{m}']:.0f} %"
                                   for m in PREFILL_BLOCK_M if f"experts_ms_block_m{m}" in r)
                         + "".join(f"; W8A8 block_m {m}: {r[f'experts_a8_ms_block_m{m}']:.3f} ms "
                                   f"({r[f'experts_a8_TFLOPs_block_m{m}']:.0f} TFLOP/s)"
                                   for m in PREFILL_BLOCK_M if f"experts_a8_ms_block_m{m}" in r))
    step = result.get("step")
    if isinstance(step, dict) and "floor_ms" in step:
        for name in ("graph", "graph_grouped_only"):
            if f"{name}_ms" in step:
                lines.append(f"step batch 1 ({name}): {step[name + '_ms']:.3f} ms vs floor {step['floor_ms']:.3f} ms = "
                             f"{step[name + '_over_floor']:.2f}x")
        one = [r for r in result.get("decode") or [] if isinstance(r, dict) and r.get("tokens") == 1]
        if one and "graph_ms" in step:  # where the step's time goes: its MoE layers as measured alone, the rest
            moe_ms, moe_floor = step["moe_layers"] * one[0]["default_ms"], step["moe_layers"] * one[0]["floor_ms"]
            rest, rest_floor = step["graph_ms"] - moe_ms, step["floor_ms"] - moe_floor
            lines.append(f"  of which {step['moe_layers']} MoE layers ~{moe_ms:.3f} ms (floor {moe_floor:.3f}), the rest "
                         f"(Mamba, attention, norms, lm_head) ~{rest:.3f} ms (floor {rest_floor:.3f}, "
                         f"{rest / rest_floor:.2f}x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="sections to skip: decode prefill fp8_decode fp8_prefill step")
    parser.add_argument("--prefill-tokens", type=int, nargs="*", default=[PREFILL_TOKENS],
                        help="token counts of the prefill sections (GPU)")
    parser.add_argument("--decode-tokens", type=int, nargs="*", default=list(DECODE_BATCHES),
                        help="token counts of the decode section (GPU; fp8_decode takes the first four)")
    args = parser.parse_args()
    if not args.decode_tokens or min(args.decode_tokens) < 1:
        parser.error(f"--decode-tokens takes one or more token counts >= 1, got {args.decode_tokens}")
    started = time.perf_counter()
    device = torch.device(args.device)
    data = json.loads(args.config.read_text())
    cpu = device.type == "cpu"
    if cpu:  # smoke run: tiny shapes, same code path
        data.update(TINY)
    config = ModelConfig.from_hf_dict(data)
    timer = Timer(device, args.quick or cpu)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if not cpu else "cpu",
                              "torch": torch.__version__, "config": args.config.name, "tiny": cpu,
                              "timing": "do_bench median of CUDA-event-timed graph replays, L2 flushed per run"}
    try:
        import triton

        from hybridserve.kernels.moe_small_triton import SMALL_M_MAX_PAIRS

        result["triton"], result["small_m_max_pairs"] = triton.__version__, SMALL_M_MAX_PAIRS
    except ImportError:
        result["triton"] = None
    result["ceilings"] = ceil = ceilings(device, timer, big=not cpu)
    print(f"{result['device']}: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.1f} TFLOP/s",
          flush=True)
    batches, prefill, copies = ((tuple(args.decode_tokens), tuple(args.prefill_tokens), LAYER_COPIES) if not cpu
                                else ((1, 4), (64,), 2))
    sections: dict[str, Callable[[], Any]] = {
        "decode": lambda: bench_decode(config, device, timer, ceil, False, batches, copies),
        "prefill": lambda: [bench_prefill(config, device, timer, ceil, False, n) for n in prefill],
        "fp8_decode": lambda: bench_decode(config, device, timer, ceil, True, batches[:4], copies),
        "fp8_prefill": lambda: [bench_prefill(config, device, timer, ceil, True, n) for n in prefill],
        "step": lambda: bench_model_step(config, device, timer, ceil),
    }
    run_sections(sections, args.skip, result)
    if not cpu:
        from hybridserve.kernels.moe_small_triton import _small_down_kernel, _small_up_kernel

        result["small_configs"] = {"up": _best_configs(_small_up_kernel), "down": _best_configs(_small_down_kernel)}
    result["wall_s"] = time.perf_counter() - started
    result["summary"] = [*summary(result), f"wall {result['wall_s']:.0f} s"]
    print("\n".join(result["summary"]), flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
