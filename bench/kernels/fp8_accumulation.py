"""W8A8 expert GEMMs of Nemotron-3-Nano-30B-A3B: Hopper's fp8 tensor cores accumulate in reduced precision, and
Triton on sm_90 lets them run the whole K that way unless `max_num_imprecise_acc` says otherwise. This measures
both ways of the grouped GEMM (`fast`: the whole K imprecise; `precise`: each K step folded into the fp32
accumulator, as torch._scaled_mm does by default) for time and error, beside the error fp8 quantization itself
brings, so the choice of default rests on numbers.

Per token count, per GEMM (up: [pairs, 2688] x [1856, 2688]^T per expert; down: [pairs, 1856] x [2688, 1856]^T):
  time: triton's do_bench median of CUDA-graph replays (bf16 output, as served);
  error: fp32 output against an fp32 matmul of the same dequantized fp8 operands (the accumulation's own error),
  relative rms and max over the output; `quant_err`: the fp32 matmul of the dequantized operands against one of
  the unquantized bf16 activations (the error W8A8 brings anyway).
Inputs: activations N(0, 1) with per-channel lognormal scales (outlier channels), weights N(0, 0.02) quantized per
output channel, routing uniform top-6 of 128 experts.

GPU: source .whl/setup.sh && python bench/kernels/fp8_accumulation.py --out $OUT/fp8_accumulation.json
CPU smoke run (interpreter, tiny shapes): TRITON_INTERPRET=1 python bench/kernels/fp8_accumulation.py --tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybridserve.kernels.fp8_linear import FP8, FP8_MAX  # noqa: E402
from hybridserve.kernels.fp8_linear_triton import quantize_activation_triton  # noqa: E402
from hybridserve.kernels.moe_triton import _grouped_gemm, choose_block_m, moe_align_triton  # noqa: E402

logger = logging.getLogger(__name__)
SHAPES = {"full": dict(hidden=2688, inter=1856, experts=128, top_k=6, tokens=(64, 1024, 8192)),
          "tiny": dict(hidden=64, inter=32, experts=8, top_k=2, tokens=(16,))}


def _median_ms(fn, device: torch.device) -> float:
    """do_bench median of graph replays on the GPU; perf_counter on the CPU."""
    if device.type == "cuda":
        from cuda_graph import capture
        from triton.testing import do_bench

        return float(do_bench(capture(fn).replay, warmup=25, rep=200, return_mode="median"))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _quantize_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] fp32 -> fp8 and its per-(expert, output channel) scale [E, N]."""
    scale = w.abs().amax(dim=2).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, :, None]).to(FP8), scale.float()


def _reference(a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, row_div: int) -> torch.Tensor:
    """out[p] = a[p // row_div] @ w[ids[p]]^T in fp32 (a [rows, K], w [E, N, K] fp32) -> [pairs, N]."""
    pairs = ids.numel()
    out = torch.empty(pairs, w.shape[1], dtype=torch.float32, device=a.device)
    rows = torch.arange(pairs, device=a.device) // row_div
    for e in ids.unique().tolist():
        sel = (ids == e).nonzero().squeeze(1)
        out[sel] = a[rows[sel]] @ w[e].T
    return out


def _errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = out.float() - ref
    return {"rel_rms": float(diff.norm() / ref.norm()), "rel_max": float(diff.abs().max() / ref.abs().max())}


def measure(tokens: int, shape: dict, device: torch.device, gen: torch.Generator) -> list[dict[str, Any]]:
    """Both GEMMs at `tokens`, each accumulation mode."""
    hidden, inter, experts, top_k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    ids = torch.rand(tokens, experts, generator=gen, device=device).topk(top_k, dim=1).indices.reshape(-1)
    pairs = ids.numel()
    block_m = choose_block_m(pairs, experts)
    align = moe_align_triton(ids, experts, block_m)
    rows = []
    for gemm, k_dim, n_dim, n_rows, row_div in (("up", hidden, inter, tokens, top_k), ("down", inter, hidden, pairs, 1)):
        channel = torch.exp(0.7 * torch.randn(k_dim, generator=gen, device=device))  # outlier channels
        x = (torch.randn(n_rows, k_dim, generator=gen, device=device) * channel).to(torch.bfloat16)
        w_q, w_scale = _quantize_weights(0.02 * torch.randn(experts, n_dim, k_dim, generator=gen, device=device))
        x_q, x_scale = quantize_activation_triton(x)  # [rows, K] fp8, [rows, 1]
        w_deq = w_q.float() * w_scale[:, :, None]
        exact = _reference(x_q.float() * x_scale, w_deq, ids, row_div)
        unquantized = _reference(x.float(), w_deq, ids, row_div)
        row: dict[str, Any] = {"tokens": tokens, "gemm": gemm, "pairs": pairs, "block_m": block_m,
                               "quant_err": _errors(exact, unquantized)}
        for mode, fast in (("fast", True), ("precise", False)):
            out32 = torch.empty(pairs, n_dim, dtype=torch.float32, device=device)
            _grouped_gemm(x_q, w_q, w_scale, out32, align, pairs, row_div, block_m, relu2=False, a_scale=x_scale,
                          fp8_fast_acc=fast)
            out16 = torch.empty(pairs, n_dim, dtype=torch.bfloat16, device=device)
            ms = _median_ms(lambda f=fast, o=out16: _grouped_gemm(  # type: ignore[misc]
                x_q, w_q, w_scale, o, align, pairs, row_div, block_m, relu2=False, a_scale=x_scale,
                fp8_fast_acc=f), device)
            row[mode] = {"ms": ms, "TFLOPs": 2 * pairs * k_dim * n_dim / ms / 1e9, **_errors(out32, exact)}
        row["precise_over_fast"] = row["precise"]["ms"] / row["fast"]["ms"]
        logger.info("%s", json.dumps(row))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run under the interpreter)")
    parser.add_argument("--tokens", type=int, nargs="*", default=None,
                        help="token counts to measure (default 64 1024 8192; each autotunes its own kernels)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    shape = SHAPES["tiny" if args.tiny else "full"]
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = args.tokens or shape["tokens"]
    if any(n < 1 for n in tokens):
        parser.error(f"--tokens takes counts >= 1, got {tokens}")
    rows = [r for n in tokens for r in measure(n, shape, device, gen)]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
