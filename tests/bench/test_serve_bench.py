"""bench/serving/serve.py against a live server (the tiny model on CPU: one prefill and one decode worker behind the
router's HTTP door): each workload writes a result JSON with the metrics and non-empty PNGs; a sweep and
--compare plot; the `hybridserve bench serve` entry point; a workload beyond the context length is refused."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import serve as bench_serve

from hybridserve import cli

DISTRIBUTIONS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
PLOTS = importlib.util.find_spec("matplotlib") is not None  # the `plot` extra; `test` alone runs with --no-plots


def _run(server, tmp_path: Path, name: str, *argv: str) -> int:
    return bench_serve.main(["--base-url", server.base_url, "--result-dir", str(tmp_path), "--result-name", name,
                             "--seed", "1", *argv, *(() if PLOTS else ("--no-plots",))])


def _load(path: Path) -> dict:
    assert path.is_file(), path
    return json.loads(path.read_text())


def _nonempty_png(path: Path) -> None:
    if not PLOTS:
        assert not path.exists()
        return
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_metrics(result: dict, num_requests: int) -> dict:
    m = result["metrics"]
    assert m["completed"] == num_requests and m["failed"] == 0 and m["failure_reasons"] == {}
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert m["total_token_throughput"] > m["output_throughput"]
    for key in DISTRIBUTIONS:
        d = m[key]
        assert d["mean"] > 0 and d["p50"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
    assert m["prefix_hit_source"] == "usage" and 0.0 <= m["prefix_hit_ratio"] < 1.0
    assert m["spec_acceptance_length"] is None  # no speculative decoding here
    assert result["counters_delta"] is not None and len(result["config"]["metrics_urls"]) == 3  # router + 2 workers
    requests = result["requests"]
    assert len(requests) == num_requests and all(r["success"] for r in requests)
    assert all(r["output_tokens"] == r["max_tokens"] and r["finish_reason"] == "length" for r in requests)
    assert all(1 <= len(r["itl"]) <= r["output_tokens"] - 1 for r in requests)  # a gap per token-carrying chunk
    return m


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-bench")


def test_random_sweep(server, out_dir) -> None:
    rc = _run(server, out_dir, "rnd", "--workload", "random", "--num-prompts", "6", "--input-len", "40",
              "--output-len", "6", "--range-ratio", "0.5", "--request-rate", "20,inf", "--max-concurrency", "4",
              "--warmup", "2")  # warm-up requests are sent first and left out of every result
    assert rc == 0
    for tag in ("20", "inf"):
        result = _load(out_dir / f"rnd-rate{tag}.json")
        _check_metrics(result, 6)
        assert result["config"]["request_rate"] == (20.0 if tag == "20" else "inf")
        _nonempty_png(out_dir / f"rnd-rate{tag}-cdf.png")
    sweep = _load(out_dir / "rnd-sweep.json")
    assert [r["request_rate"] for r in sweep["runs"]] == [20.0, "inf"]
    _nonempty_png(out_dir / "rnd-sweep.png")


def test_shared_prefix_hits_the_cache(server, out_dir) -> None:
    rc = _run(server, out_dir, "shared", "--workload", "shared-prefix", "--num-prompts", "8", "--num-groups", "2",
              "--prefix-len", "96", "--input-len", "16", "--output-len", "4", "--request-rate", "30", "--arrival",
              "fixed")
    assert rc == 0
    result = _load(out_dir / "shared-rate30.json")
    m = _check_metrics(result, 8)
    assert m["prefix_hit_ratio"] > 0.2  # later requests of a group reuse its 96-token prefix
    assert sorted({r["group"] for r in result["requests"]}) == [0, 1]
    _nonempty_png(out_dir / "shared-rate30-cdf.png")


def test_multi_turn_sends_the_history(server, out_dir) -> None:
    rc = _run(server, out_dir, "chat", "--workload", "multi-turn", "--num-conversations", "3", "--num-turns", "3",
              "--input-len", "20", "--output-len", "6", "--request-rate", "inf", "--max-concurrency", "2")
    assert rc == 0
    result = _load(out_dir / "chat-rateinf.json")
    m = _check_metrics(result, 9)
    assert m["prefix_hit_ratio"] > 0  # a later turn resumes from the earlier one's checkpoint
    turns: dict[int, list[dict]] = {}
    for r in result["requests"]:
        turns.setdefault(r["session_id"], []).append(r)
    assert sorted(turns) == [0, 1, 2]
    for conv in turns.values():
        assert [r["turn"] for r in conv] == [0, 1, 2]
        for prev, cur in zip(conv, conv[1:]):
            assert cur["start"] >= prev["start"] + prev["e2e"]  # turns of a conversation are sequential
            assert cur["prompt_len"] > prev["prompt_len"] + prev["output_tokens"]  # history + answer + new message
    _nonempty_png(out_dir / "chat-rateinf-cdf.png")


def test_compare_runs_and_sweeps(out_dir) -> None:
    runs = [out_dir / "rnd-rate20.json", out_dir / "shared-rate30.json", out_dir / "chat-rateinf.json"]
    if not all(p.is_file() for p in runs):
        pytest.skip("needs the runs above")
    if not PLOTS:
        pytest.skip("--compare draws plots: needs the `plot` extra (matplotlib)")
    assert bench_serve.main(["--compare", *map(str, runs), "--labels", "random,shared,chat",
                             "--result-dir", str(out_dir), "--result-name", "cmp"]) == 0
    _nonempty_png(out_dir / "cmp.png")
    sweep = str(out_dir / "rnd-sweep.json")
    argv = ["--compare", sweep, sweep, "--result-dir", str(out_dir), "--result-name", "cmp-sweep"]
    assert bench_serve.main(argv) == 0
    _nonempty_png(out_dir / "cmp-sweep.png")
    with pytest.raises(SystemExit):  # a run and a sweep do not mix
        bench_serve.main(["--compare", str(runs[0]), sweep, "--result-dir", str(out_dir)])


def test_context_too_long_is_refused_before_sending(server, tmp_path, capsys) -> None:
    rc = _run(server, tmp_path, "long", "--workload", "multi-turn", "--num-prompts", "1", "--num-turns", "4",
              "--input-len", "60", "--output-len", "10")
    assert rc == 2 and "max_model_len is 256" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_hybridserve_bench_serve_entry_point(server, tmp_path, capsys) -> None:
    assert cli.main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "2", "--input-len", "8",
                     "--output-len", "3", "--no-plots", "--no-scrape", "--result-dir", str(tmp_path),
                     "--result-name", "cli"]) == 0
    result = _load(tmp_path / "cli-rateinf.json")
    assert result["metrics"]["completed"] == 2 and result["counters_delta"] is None
    assert not list(tmp_path.glob("*.png"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "serve", "--arrival", "bursty"])
    assert exc.value.code == 2 and "--arrival" in capsys.readouterr().err
