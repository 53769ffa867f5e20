"""bench/kernels/chain_floor.py: the op sequence it streams is the decode step's, op for op and byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chain_floor import moe_layer_ops, op_sequence
from moe import CONFIG, TINY

from hybridserve.common.model_config import ModelConfig
from hybridserve.models.weights import dummy_model

BENCH = Path(__file__).parents[2] / "bench" / "kernels" / "chain_floor.py"


def _tiny_config() -> ModelConfig:
    data = json.loads(CONFIG.read_text())
    data.update(TINY)  # "MEM*E": every layer kind of a Nemotron 3 step, at tiny shapes
    return ModelConfig.from_hf_dict(data)


def test_ops_follow_the_layers_and_read_the_step_weights() -> None:
    config = _tiny_config()
    model = dummy_model(config, torch.bfloat16, torch.device("cpu"))
    ops = op_sequence(config)
    expected: list[tuple[str, int]] = [("embed", 0), ("norm", 0)]
    for block in model.layers:
        mixer = block.mixer
        if block.kind == "mamba":
            heads, head_dim = config.mamba.num_heads, config.mamba.head_dim
            state = 2 * heads * head_dim * config.mamba.state_size * 4  # fp32 state read + written
            expected += [("in_proj", mixer.in_proj.weight.nbytes), ("conv", 0), ("state", state),
                         ("gated_norm", 0), ("out_proj", mixer.out_proj.weight.nbytes), ("add_norm", 0)]
        elif block.kind == "moe":
            k = config.moe.experts_per_token
            experts, shared = mixer.experts, mixer.shared_experts
            expected += [("router", mixer.gate.weight.nbytes),  # fp32, as transformers keeps it
                         ("up", k * experts.up_proj[0].nbytes + shared.up_proj.weight.nbytes),
                         ("down", k * experts.down_proj[0].nbytes + shared.down_proj.weight.nbytes), ("add_norm", 0)]
        else:
            qkv = sum(p.weight.nbytes for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
            kv = 2 * config.attention.num_kv_heads * config.attention.head_dim * 512 * 2
            expected += [("qkv", qkv), ("write_kv", 0), ("attn_decode", kv), ("combine", 0),
                         ("o_proj", mixer.o_proj.weight.nbytes), ("add_norm", 0)]
    expected += [("final_norm", 0), ("lm_head", model.lm_head.weight.nbytes)]
    assert ops == expected


def test_the_30b_sequence_has_the_step_kernel_count() -> None:
    """270 ops, 157 of them reading bytes: the batch-1 step's graph has 270 kernels (bench/kernels/step_profile.py)."""
    ops = op_sequence(ModelConfig.from_hf_dict(json.loads(CONFIG.read_text())))
    assert len(ops) == 270 and sum(1 for _, size in ops if size) == 157


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_without_a_gpu_it_says_so(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--config", str(CONFIG), "--out", str(tmp_path / "c.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "run it on a CUDA device" in done.stderr


def test_the_moe_layer_ops_are_bench_moe_floor_bytes() -> None:
    """Router (fp32) + the k routed and the shared expert's up rows + their down rows: 37.9 us of bytes at the
    the 4243 GB/s copy bandwidth measured beside it, bench/kernels/moe.py's layer floor."""
    config = ModelConfig.from_hf_dict(json.loads(CONFIG.read_text()))
    ops = moe_layer_ops(config)
    assert [name for name, _ in ops] == ["router", "up", "down"]
    assert sum(size for _, size in ops) / 4243e9 * 1e6 == pytest.approx(37.9, abs=0.1)
    with pytest.raises(ValueError, match="no MoE layers"):
        moe_layer_ops(ModelConfig.from_hf_dict(json.loads((CONFIG.parent / "nemotron-nano-9b-v2.json").read_text())))
