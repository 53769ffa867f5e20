"""The throughput benchmark's pure parts: the decode step's bytes floor, flag parsing and the table row."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "serving"))

import step_floor  # noqa: E402
import throughput  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"


def test_concurrencies_parse_k_suffix_and_reject_zero() -> None:
    assert throughput.concurrencies("64, 256,1k") == [64, 256, 1024]
    with pytest.raises(argparse.ArgumentTypeError):
        throughput.concurrencies("0")
    with pytest.raises(argparse.ArgumentTypeError):
        throughput.concurrencies(",")


def test_state_dtypes_follow_flags_then_checkpoint() -> None:
    cfg = {"mamba_ssm_cache_dtype": "float32"}
    assert throughput.state_dtypes(cfg, []) == ("float32", "bfloat16")
    assert throughput.state_dtypes(cfg, ["--mamba-ssm-cache-dtype", "bfloat16", "--kv-cache-dtype=fp8"]) == \
        ("bfloat16", "fp8")
    assert throughput.flag_value(["--max-num-seqs", "512"], "--max-num-seqs") == "512"


def test_experts_touched_is_uniform_routing_expectation() -> None:
    assert step_floor.experts_touched(128, 6, 1) == pytest.approx(6.0)
    assert step_floor.experts_touched(128, 6, 1024) == pytest.approx(128.0, rel=1e-6)
    assert step_floor.experts_touched(0, 0, 64) == 0.0


def test_nano_9b_weights_and_state_bytes() -> None:
    """The 9B's weights without the embedding table are ~16.7 GB in bf16; its fp32 SSM state per sequence is
    27 Mamba layers x 128 heads x 80 x 128 x 4 bytes."""
    mb = step_floor.model_bytes(json.loads((CONFIGS / "nemotron-nano-9b-v2.json").read_text()))
    assert mb.num_experts == 0 and mb.routed_experts == 0
    assert 16.0e9 < mb.weights < 17.5e9
    assert mb.ssm_state == 27 * 128 * 80 * 128
    assert mb.kv_token == 4 * 2 * 8 * 128
    parts = step_floor.step_bytes(mb, 128, 512, ssm_dtype="float32")
    assert parts["ssm_state"] == 2 * 128 * mb.ssm_state * 4
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    half = step_floor.step_bytes(mb, 128, 512, ssm_dtype="bfloat16", kv_dtype="fp8")
    assert half["ssm_state"] == parts["ssm_state"] / 2 and half["kv"] == parts["kv"] / 2
    assert step_floor.floor_ms(4.25e12, 4250.0) == pytest.approx(1000.0)
    with pytest.raises(ValueError):
        step_floor.step_bytes(mb, 0, 512)


def test_fp8_config_halves_the_30b_experts() -> None:
    cfg = json.loads((CONFIGS / "nemotron-3-nano-30b-a3b.json").read_text())
    bf16 = step_floor.model_bytes(cfg)
    fp8 = step_floor.model_bytes(step_floor.with_fp8_quantization(cfg))
    assert bf16.num_experts == 128 and bf16.experts_per_token == 6
    assert fp8.routed_experts < 0.51 * bf16.routed_experts
    # dense linears fp8 too, but for the recipe's bf16 layers (attention, the Mamba layers before it), lm_head, norms
    assert fp8.dense < 0.75 * bf16.dense
    one, full = step_floor.step_bytes(fp8, 1, 0), step_floor.step_bytes(fp8, 1024, 0)
    assert one["weights"] < full["weights"] - 0.9 * fp8.routed_experts


def test_table_row_names_floor_and_refused() -> None:
    dist = {"p50": 40.0, "p99": 60.0}
    result = {"concurrency": 256, "num_prompts": 512, "floor": {"ms": 21.5, "batch": 256},
              "metrics": {"output_throughput": 6345.2, "tpot_ms": dist, "itl_ms": dist,
                          "ttft_ms": {"p50": None, "p99": None}, "failed": 3}}
    row = throughput.table_row("9b", result)
    assert row.startswith("| 9b | 256 | 512 | 6,345 | 40.0 / 60.0 | 21.5 (256) |")
    assert row.endswith("| - | 3 / 512 |")


def test_port_in_use_sees_a_listener() -> None:
    """A server left on the port would answer /ready for a new one: the harness refuses to start then."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert throughput.port_in_use(sock.getsockname()[1])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert not throughput.port_in_use(free)


def test_sweep_rows_are_valid_serve_flags() -> None:
    """Every row of bench/serving/h200_sweep.sh (its server flags, with the EXTRA the recipe rows use) parses as
    `hybridserve serve` flags, so a GPU lease never starts a sweep that dies on a typo."""
    import shlex
    import subprocess

    from hybridserve.cli import build_parser

    script = Path(__file__).parents[2] / "bench" / "serving" / "h200_sweep.sh"
    table = script.read_text().split("CFG=bench/configs\n", 1)[1].split("\n[ \"$#\" -eq 0 ]", 1)[0]
    listing = subprocess.run(["bash", "-c", "CFG=bench/configs\n" + table + '\nfor k in "${!ROWS[@]}"; do '
                              'printf "%s\\t%s\\n" "$k" "${ROWS[$k]}"; done'],
                             capture_output=True, text=True, check=True).stdout
    rows = dict(line.split("\t", 1) for line in listing.splitlines())
    assert {"9b-mem64", "9b-mem1024", "30b-fp8-1024", "30b-bf16-1024"} <= set(rows)
    extra = ["--kv-cache-dtype", "fp8", "--mamba-ssm-cache-dtype", "bfloat16", "--prefill-chunk-size", "8192"]
    for name, spec in rows.items():
        label, config, fp8, levels, waves, *flags = shlex.split(spec)
        assert Path(config).name.endswith(".json") and fp8 in ("0", "1") and int(waves) > 0, name
        assert all(int(n) > 0 for n in levels.split(",")), name
        args = build_parser().parse_args(["serve", *flags, *extra])
        assert args.max_num_seqs > 0, name
