"""What a chain of one kernel per op can reach at best in a batch-1 decode step (is 1.3x the floor within
reach of the kernel-per-op design?).

The step's op sequence comes from the model config, in layer order: every projection, the active experts' up and
down rows, the router, the Mamba state (read + written) and the KV read become one *streaming* kernel reading
that many bytes of its own buffer (no compute: a sum per program), and every small op (conv update, gated norm,
residual add + norm, KV write, split combine) a one-program kernel. Each kernel waits for the one before it, as
the step's kernels do: under programmatic dependent launch (`pdl_gate` first, the streaming kernels sending
their first lines to L2 before it, as the skinny projection does) or plain graph order. All of it is one CUDA
graph, timed as replays (median of groups of 10), weights cold (6.5 GB of buffers for 30B-A3B, far past L2).

Rows: the whole chain (4 streaming programs per SM; also 2 and 8, and each program sending its whole run to L2
before the gate); without PDL; the streaming kernels alone (small ops removed); one streaming kernel over all the
bytes (this kernel's own bandwidth); floor = the chain's bytes over torch's copy bandwidth (read + write, measured
as bench/kernels/moe.py measures it for the step's floor). Then the MoE layer alone (router, up, down) repeated as
bench/kernels/moe.py's 4 copies and as the model's MoE layer count, per layer beside its floor. If even such a chain sits
near 1.3x the floor, kernels of real work cannot get below it, and the lever is fewer kernel boundaries (a
persistent decode kernel), not faster kernels.

    python bench/kernels/chain_floor.py --config bench/configs/nemotron-3-nano-30b-a3b.json --out chain.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_graph import capture  # noqa: E402
from moe import LAYER_COPIES, Timer, ceilings  # noqa: E402
from step_profile import replay_ms  # noqa: E402

from hybridserve.common.model_config import ModelConfig  # noqa: E402
from hybridserve.kernels.triton_utils import cdiv, pdl_gate, prefetch_l2  # noqa: E402

CONTEXT = 512  # tokens of KV per attention layer, as bench/kernels/step_profile.py
ROWS, BLOCK = 8, 1024  # elements per program and loop step: [8, 1024] bf16 = 16 KB in flight
BF16, FP32 = 2, 4  # bytes per element: weights and KV / the router weight and the SSM state


@triton.jit
def _stream_kernel(src_ptr, out_ptr, per_prog, ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                   PREFETCH_ALL: tl.constexpr):
    """Program p sums src[p * per_prog : (p + 1) * per_prog] (bf16, per_prog a multiple of ROWS * BLOCK: no
    masks, 16-byte loads) into out[p]."""
    start = tl.program_id(0).to(tl.int64) * per_prog
    if USE_PDL:  # the first 16 lines of this program's run (or all of it) head for L2 before the gate
        if PREFETCH_ALL:
            for line in range(start, start + per_prog, 16 * 64):
                prefetch_l2(src_ptr + line + tl.arange(0, 16) * 64)
        else:
            prefetch_l2(src_ptr + start + tl.arange(0, 16) * 64)
    pdl_gate(USE_PDL)
    offs = tl.arange(0, ROWS)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for off in range(start, start + per_prog, ROWS * BLOCK):
        acc += tl.load(src_ptr + tl.multiple_of(off, ROWS * BLOCK) + offs).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def _small_op_kernel(src_ptr, out_ptr, USE_PDL: tl.constexpr):
    """One program: wait for the kernel before, read one value, write one."""
    pdl_gate(USE_PDL)
    tl.store(out_ptr, tl.load(src_ptr).to(tl.float32) + 1.0)


def moe_layer_ops(config: ModelConfig) -> list[tuple[str, int]]:
    """A MoE layer's three streaming ops at one token: the router (fp32 weight), then the k routed experts' and the
    shared expert's up rows, then their down rows (bf16) -- bench/kernels/moe.py's layer and its floor's bytes."""
    e = config.moe
    if e is None:
        raise ValueError(f"{config.architecture} config has no MoE layers")
    rows = e.experts_per_token * e.intermediate_size + e.shared_intermediate_size
    hidden = config.hidden_size
    return [("router", e.num_experts * hidden * FP32), ("up", rows * hidden * BF16), ("down", rows * hidden * BF16)]


def op_sequence(config: ModelConfig) -> list[tuple[str, int]]:
    """(op, bytes it must read; 0 for a small op) in the order a batch-1 decode step runs them."""
    hidden = config.hidden_size
    ops: list[tuple[str, int]] = [("embed", 0), ("norm", 0)]
    for kind in config.layer_types:
        if kind == "mamba":
            m = config.mamba
            assert m is not None
            inner = m.num_heads * m.head_dim
            in_proj = inner + (inner + 2 * m.n_groups * m.state_size) + m.num_heads
            state = 2 * inner * m.state_size * FP32  # SSM state, read + written
            ops += [("in_proj", in_proj * hidden * BF16), ("conv", 0), ("state", state), ("gated_norm", 0),
                    ("out_proj", inner * hidden * BF16), ("add_norm", 0)]
        elif kind == "moe":
            ops += [*moe_layer_ops(config), ("add_norm", 0)]
        elif kind == "attention":
            a = config.attention
            assert a is not None
            ops += [("qkv", (a.num_heads + 2 * a.num_kv_heads) * a.head_dim * hidden * BF16), ("write_kv", 0),
                    ("attn_decode", 2 * a.num_kv_heads * a.head_dim * CONTEXT * BF16), ("combine", 0),
                    ("o_proj", a.num_heads * a.head_dim * hidden * BF16), ("add_norm", 0)]
        elif kind == "mlp":
            size = config.mlp_intermediate_size or 0
            ops += [("mlp_up", size * hidden * BF16), ("relu2", 0), ("mlp_down", size * hidden * BF16),
                    ("add_norm", 0)]
    return ops + [("final_norm", 0), ("lm_head", config.vocab_size * hidden * BF16)]


class Chain:
    """The kernels of one op sequence with their buffers: `run()` launches them in order."""

    def __init__(self, ops: list[tuple[str, int]], device: torch.device, pdl: bool, small_ops: bool,
                 per_sm: int = 4, prefetch_all: bool = False) -> None:
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.pdl, self.prefetch_all = pdl, prefetch_all
        self.launches: list[tuple[torch.Tensor, int, int]] = []  # (buffer, programs, elements per program)
        step = ROWS * BLOCK
        for _, size in ops:
            if size:  # up to per_sm programs per SM, each a whole number of loop steps (a few KB past the op's bytes)
                elements = cdiv(size, BF16)
                programs = max(1, min(per_sm * self.sms, cdiv(elements, step)))
                per_prog = cdiv(cdiv(elements, programs), step) * step
                buffer = torch.empty(programs * per_prog, dtype=torch.bfloat16, device=device)
                self.launches.append((buffer, programs, per_prog))
            elif small_ops:
                self.launches.append((torch.zeros(1, dtype=torch.bfloat16, device=device), 0, 0))
        self.out = torch.zeros(per_sm * self.sms, dtype=torch.float32, device=device)

    def run(self) -> None:
        for src, programs, per_prog in self.launches:
            if programs == 0:
                _small_op_kernel[(1,)](src, self.out, USE_PDL=self.pdl, launch_pdl=self.pdl, num_warps=1)
            else:
                _stream_kernel[(programs,)](src, self.out, per_prog, ROWS=ROWS, BLOCK=BLOCK, USE_PDL=self.pdl,
                                            PREFETCH_ALL=self.prefetch_all, launch_pdl=self.pdl, num_warps=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a config.json (bench/configs/)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("chain_floor.py measures GPU kernel chains: run it on a CUDA device")
    device = torch.device("cuda")
    config = ModelConfig.from_hf_dict(json.loads(Path(args.config).read_text()))
    ops = op_sequence(config)
    total = sum(size for _, size in ops)
    bandwidth = ceilings(device, Timer(device, quick=False), big=True)["copy_GBps"]  # as bench/kernels/moe.py's floor
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "config": Path(args.config).name,
                              "ops": len(ops), "streaming_ops": sum(1 for _, s in ops if s), "read_GB": total / 1e9,
                              "copy_GBps": bandwidth, "floor_ms": total / bandwidth / 1e6}
    one = Chain([("all", total)], device, pdl=False, small_ops=False)
    result["one_kernel_ms"] = replay_ms(capture(one.run), 20)
    del one
    variants = [("chain_pdl", True, True, 4, False), ("chain_plain", False, True, 4, False),
                ("streaming_only_pdl", True, False, 4, False), ("chain_pdl_2_per_sm", True, True, 2, False),
                ("chain_pdl_8_per_sm", True, True, 8, False), ("chain_pdl_prefetch_all", True, True, 4, True),
                ("streaming_only_pdl_prefetch_all", True, False, 4, True)]
    for name, pdl, small, per_sm, prefetch_all in variants:
        chain = Chain(ops, device, pdl, small, per_sm, prefetch_all)
        graph = capture(chain.run)
        result[f"{name}_kernels"] = len(chain.launches)
        result[f"{name}_ms"] = replay_ms(graph)
        result[f"{name}_over_floor"] = result[f"{name}_ms"] / result["floor_ms"]
        del graph, chain
        torch.cuda.empty_cache()
    result["one_kernel_over_floor"] = result["one_kernel_ms"] / result["floor_ms"]
    if config.moe is not None:  # the MoE layer alone, as bench/kernels/moe.py times it and as the model runs it
        layer = moe_layer_ops(config)
        result["moe_layer_floor_us"] = sum(size for _, size in layer) / bandwidth / 1e3
        for copies in (LAYER_COPIES, len(config.layers_of("moe"))):
            chain = Chain(layer * copies, device, pdl=True, small_ops=True)
            result[f"moe_layer_chain_us_{copies}_copies"] = replay_ms(capture(chain.run)) * 1e3 / copies
            result[f"moe_layer_chain_{copies}_copies_over_floor"] = (
                result[f"moe_layer_chain_us_{copies}_copies"] / result["moe_layer_floor_us"])
            del chain
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1))
    for key, value in result.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}", flush=True)


if __name__ == "__main__":
    main()
