"""The demo-model tools of tools/demo_model/: mamba_ssm's autotuner picks pinned from a file (train_demo_scan), the
decoding-default pick on validation prompts (demo_parse_eval.select), and train_demo's --profile-steps run."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import demo_parse_eval as parse_mod  # tools/demo_model/ is on pytest's pythonpath
import pytest
import train_demo_scan as scan_mod
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 32}, num_warps=8)],
                 key=["n"])
@triton.jit
def _tuned_kernel(x_ptr, n, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], dtype=tl.float32), mask=tl.arange(0, BLOCK) < n)


@pytest.fixture
def fake_mamba_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """_tuned_kernel as an autotuned kernel of a loaded `mamba_ssm.ops.triton` module, its configs restored after."""
    module = types.ModuleType("mamba_ssm.ops.triton._pin_test")
    module.kernel = _tuned_kernel
    monkeypatch.setitem(sys.modules, module.__name__, module)
    configs, cache = list(_tuned_kernel.configs), dict(_tuned_kernel.cache)
    yield f"{module.__name__}.kernel"
    _tuned_kernel.configs, _tuned_kernel.cache = configs, cache


def test_pinned_configs_round_trip(fake_mamba_module: str, tmp_path: Path) -> None:
    both = list(_tuned_kernel.configs)
    _tuned_kernel.cache[(1024,)] = both[1]  # what a tuning run leaves behind
    picks = scan_mod.tuned_configs()
    assert picks[fake_mamba_module] == [{"kwargs": {"BLOCK": 32}, "num_warps": 8, "num_stages": both[1].num_stages,
                                         "num_ctas": 1}]
    path = tmp_path / "picks.json"
    path.write_text(json.dumps(picks))
    _tuned_kernel.cache.clear()
    assert scan_mod.pin_configs(path) == 1
    assert _tuned_kernel.configs == [both[1]]  # one config left: the autotuner benchmarks nothing


def test_stale_or_foreign_picks_keep_every_config(fake_mamba_module: str, tmp_path: Path) -> None:
    both = list(_tuned_kernel.configs)
    path = tmp_path / "picks.json"
    foreign = {"kwargs": {"BLOCK": 64}, "num_warps": 2, "num_stages": 1, "num_ctas": 1}
    path.write_text(json.dumps({fake_mamba_module: [foreign], "mamba_ssm.other.kernel": [foreign]}))
    assert scan_mod.pin_configs(path) == 0
    assert _tuned_kernel.configs == both


def _row(parsed: int, penalty: float, ngram: int) -> dict:
    return {"parsed": parsed, "repetition_penalty": penalty, "no_repeat_ngram_size": ngram}


def test_select_takes_the_most_parsed_then_the_mildest_setting() -> None:
    rows = [_row(90, 1.0, 0), _row(95, 1.2, 8), _row(95, 1.1, 8), _row(95, 1.1, 16), _row(95, 1.1, 0)]
    assert parse_mod.select(rows) == _row(95, 1.1, 0)  # tie: lowest penalty, then no ban
    assert parse_mod.select(rows[:4]) == _row(95, 1.1, 16)  # then the longer (milder) n-gram ban
    assert parse_mod.select([_row(90, 1.0, 0), _row(91, 1.2, 4)]) == _row(91, 1.2, 4)


def test_profile_steps_writes_the_kernel_table_and_no_model(tmp_path: Path, train_demo: types.ModuleType) -> None:
    out = tmp_path / "run"
    tiny = ["--hidden", "32", "--mlp-intermediate", "64", "--heads", "2", "--kv-heads", "1", "--mamba-head-dim", "8",
            "--ssm-state", "8", "--n-groups", "1", "--chunk-size", "8", "--vocab-size", "280", "--tokenizer-mb",
            "0.2", "--seq-len", "32", "--batch-size", "2", "--max-files", "20"]
    code = train_demo.main(["--out-dir", str(out), "--device", "cpu", "--max-steps", "20", "--calib-steps", "12",
                            "--profile-steps", "2", *tiny])
    assert code == 0
    table = (out / "profile.txt").read_text()
    assert table.startswith("2 steps profiled") and "aten::" in table
    assert not (out / "model.safetensors").exists()


def test_engine_eval_parses_every_prompt_and_measures_acceptance_on_the_first_ones() -> None:
    import time

    import train_demo_eval

    demo = Path(__file__).resolve().parents[2] / "models" / "demo_model"
    prompts = ["def f(x):\n", "import os\n", "class A:\n"]
    result = train_demo_eval.engine_eval(demo, prompts, 8, 1, time.perf_counter() + 600, acceptance_prompts=2)
    assert len(result["texts"]) == len(result["bare_texts"]) == 3
    assert set(result["acceptance_length"]) == {1} and result["acceptance_length"][1] >= 1.0
    assert result["greedy_equal"][1] == 1.0  # MTP drafts never change greedy output
    assert result["sampling_defaults"]["repetition_penalty"] == 1.1  # the checkpoint's generation_config.json
