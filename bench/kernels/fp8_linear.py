"""Dense linears of Nemotron-3-Nano-30B-A3B in fp8 (W8A8, `ops.fp8_linear`: Triton activation quantization +
torch._scaled_mm) against bf16 (`ops.linear`: the skinny Triton kernel up to its row limit, cuBLAS above), at
decode and prefill row counts, beside the floors: bytes (weight + activations in and out) over the copy bandwidth
and flops over the measured dense matmul peak of each dtype, all measured in the same run.

Timing: triton's do_bench median of CUDA-graph replays; each graph runs the projection over COPIES distinct weight
copies (>= 256 MB in all, so every call reads its weight from HBM as a decode step's layers do), time per call.

    source .whl/setup.sh && python bench/kernels/fp8_linear.py --out $OUT/fp8_linear.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_graph import capture  # noqa: E402

from hybridserve.kernels import ops  # noqa: E402
from hybridserve.kernels.fp8_linear import FP8_MAX, quantize_weight  # noqa: E402

SHAPES = {  # name: (out_features, in_features) of Nemotron-3-Nano-30B-A3B
    "mamba in_proj": (10304, 2688),
    "mamba out_proj": (2688, 4096),
    "attn qkv (fused)": (4608, 2688),
    "shared expert up": (3712, 2688),
    "shared expert down": (2688, 3712),
}
ROWS = (1, 256, 1024, 8192)
COLD_BYTES = 256 << 20


def _median_ms(fn: Callable[[], Any], quick: bool) -> float:
    return float(do_bench(fn, warmup=5 if quick else 25, rep=30 if quick else 150, return_mode="median"))


def ceilings(quick: bool) -> dict[str, float]:
    """Copy GB/s (read + write), dense bf16 and fp8 (tensor-wise scaled) matmul TFLOP/s at 8192^3."""
    n = 1 << 28
    src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    copy_ms = _median_ms(lambda: dst.copy_(src), quick)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    bf16_ms = _median_ms(lambda: a @ b, quick)
    a8, b8, one = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), torch.ones((), device="cuda")
    fp8_ms = _median_ms(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), quick)
    flops = 2 * 8192**3
    return {"copy_GBps": 2 * n * 4 / copy_ms / 1e6, "bf16_matmul_TFLOPs": flops / bf16_ms / 1e9,
            "fp8_matmul_TFLOPs": flops / fp8_ms / 1e9}


def _per_call_us(calls: list[Callable[[], Any]], quick: bool) -> float:
    graph = capture(lambda: [call() for call in calls])
    return _median_ms(graph.replay, quick) * 1e3 / len(calls)


def bench(ceil: dict[str, float], quick: bool) -> list[dict]:
    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        copies = max(2, -(-COLD_BYTES // (n * k * 2)))
        bf16 = [w.to(torch.bfloat16) for _ in range(copies)]
        q, scale = quantize_weight(w, per_channel=False)
        q_ch, scale_ch = quantize_weight(w, per_channel=True)
        fp8 = [q.clone() for _ in range(copies)]
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
            static = (x.abs().amax().float() / FP8_MAX).reshape(1)
            ref = torch.nn.functional.linear(x.float(), w)
            err_static = float((ops.fp8_linear(x, q, scale, static).float() - ref).norm() / ref.norm())
            err_dynamic = float((ops.fp8_linear(x, q_ch, scale_ch).float() - ref).norm() / ref.norm())
            bf16_us = _per_call_us([lambda w_=w_: ops.linear(x, w_) for w_ in bf16], quick)
            static_us = _per_call_us([lambda w_=w_: ops.fp8_linear(x, w_, scale, static) for w_ in fp8], quick)
            dynamic_us = _per_call_us([lambda w_=w_: ops.fp8_linear(x, w_, scale_ch)
                                       for w_ in fp8], quick)
            act_bytes = rows * (k + n) * 2  # bf16 activations in and out
            flops = 2 * rows * n * k
            row = {
                "shape": name, "out_features": n, "in_features": k, "rows": rows,
                "bf16_us": bf16_us, "fp8_static_us": static_us, "fp8_dynamic_us": dynamic_us,
                "bf16_bytes_floor_us": (n * k * 2 + act_bytes) / ceil["copy_GBps"] / 1e3,
                "fp8_bytes_floor_us": (n * k + act_bytes) / ceil["copy_GBps"] / 1e3,
                "bf16_flops_floor_us": flops / ceil["bf16_matmul_TFLOPs"] / 1e6,
                "fp8_flops_floor_us": flops / ceil["fp8_matmul_TFLOPs"] / 1e6,
                "rel_err_fp8_static_vs_fp32": err_static, "rel_err_fp8_dynamic_vs_fp32": err_dynamic,
            }
            print("  ".join(f"{key}={v:.2f}" if isinstance(v, float) else f"{key}={v}" for key, v in row.items()),
                  flush=True)
            out.append(row)
        del bf16, fp8
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    ceil = ceilings(args.quick)
    print(ceil, flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil,
              "timing": "do_bench median of CUDA-graph replays over distinct weight copies (cold in L2), per call",
              "linear": bench(ceil, args.quick)}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
