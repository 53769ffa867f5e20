"""The multiplexing serving benchmark's pure parts: options, the point plan, the goodput search, the table and the
acceptance checks; and its refusal to run without a GPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "serving"))

import multiplex  # noqa: E402


def metrics(ttft: tuple[float, float], tpot: tuple[float, float], itl: tuple[float, float], tok_s: float,
            failed: int = 0) -> dict[str, Any]:
    def d(pair: tuple[float, float]) -> dict[str, float]:
        return {"p50": pair[0], "p99": pair[1]}
    return {"ttft_ms": d(ttft), "tpot_ms": d(tpot), "itl_ms": d(itl), "output_throughput": tok_s,
            "completed": 10, "failed": failed}


def test_options_and_server_flags_after_the_separator() -> None:
    args, server = multiplex.parse_args(["--out", "/tmp/x", "--modes", "colocated,multiplexed", "--rates", "2,6",
                                         "--point-s", "5", "--", "--mamba-ssm-cache-dtype", "bfloat16"])
    assert args.modes == ["colocated", "multiplexed"] and args.rates == [2.0, 6.0] and args.point_s == 5
    assert server == ["--mamba-ssm-cache-dtype", "bfloat16"]
    for bad in (["--modes", "solo"], ["--rates", "0"], ["--rates", "inf"], ["--point-s", "0"], ["--budget-s", "-1"]):
        with pytest.raises(SystemExit):
            multiplex.parse_args(["--out", "/tmp/x", *bad])
    with pytest.raises(SystemExit):
        multiplex.parse_args([])  # --out is required


def test_points_run_the_checks_points_first_and_scale_with_the_budget_knob() -> None:
    points = multiplex.plan_points([4.0, 8.0, 16.0], point_s=10, min_prompts=16)
    assert [p.key for p in points[:4]] == ["2048/256@4", "512/128@8", "512/128@all", "2048/256@all"]
    assert len(points) == 8 and len({p.key for p in points}) == 8
    by_key = {p.key: p for p in points}
    assert by_key["512/128@16"].num_prompts == 160 and by_key["2048/256@4"].num_prompts == 40
    assert by_key["512/128@all"].num_prompts == 64 and by_key["2048/256@all"].num_prompts == 48
    assert {p.key: p.num_prompts for p in multiplex.plan_points([1.0], point_s=5, min_prompts=16)}["512/128@1"] == 16
    assert math.isinf(by_key["2048/256@all"].rate)


def test_slo_needs_both_p99s_and_no_failures() -> None:
    assert multiplex.meets_slo(metrics((300, 900), (10, 19), (9, 30), 1000), 1000, 20)
    assert not multiplex.meets_slo(metrics((300, 1100), (10, 19), (9, 30), 1000), 1000, 20)
    assert not multiplex.meets_slo(metrics((300, 900), (10, 21), (9, 30), 1000), 1000, 20)
    assert not multiplex.meets_slo(metrics((300, 900), (10, 19), (9, 30), 1000, failed=1), 1000, 20)
    none = metrics((300, 900), (10, 19), (9, 30), 1000)
    none["ttft_ms"]["p99"] = None
    assert not multiplex.meets_slo(none, 1000, 20)


def test_goodput_search_bisects_doubles_and_stops_on_budget() -> None:
    capacity = 11.0
    probed: list[float] = []

    def probe(rate: float) -> bool:
        probed.append(rate)
        return rate <= capacity

    found = multiplex.goodput_search({4.0: True, 8.0: True, 16.0: False}, probe, steps=3, max_rate=64)
    assert probed == [12.0, 10.0, 11.0] and found["goodput_rps"] == 11.0
    probed.clear()
    found = multiplex.goodput_search({4.0: True, 8.0: True, 16.0: True}, lambda r: probed.append(r) or r <= 40,
                                     steps=2, max_rate=64)
    assert probed == [32.0, 64.0] and found["goodput_rps"] == 32.0
    found = multiplex.goodput_search({4.0: False}, lambda r: r <= 1, steps=2, max_rate=64)
    assert found["goodput_rps"] == 1.0 and [p["rate"] for p in found["probes"]] == [2.0, 1.0]
    assert multiplex.goodput_search({4.0: True, 16.0: False}, lambda r: None, steps=3, max_rate=64) == {
        "goodput_rps": 4.0, "probes": [], "rates": {"4": True, "16": False}}


def test_result_table_and_acceptance_checks() -> None:
    def point(m: dict[str, Any]) -> dict[str, Any]:
        return {"num_prompts": 40, "metrics": m}

    modes = {
        "colocated": {"points": {"2048/256@4": point(metrics((77, 200), (9.2, 12), (8, 55), 900)),
                                 "512/128@8": point(metrics((32, 90), (7.6, 9), (7, 23.5), 1000)),
                                 "512/128@all": point(metrics((500, 900), (12, 14), (11, 40), 3159))},
                      "goodput": {"goodput_rps": 4.0}, "skipped": ["2048/256@all"]},
        "multiplexed": {"points": {"2048/256@4": point(metrics((80, 150), (9.0, 10), (9, 12), 950)),
                                   "512/128@8": point(metrics((40, 90), (7.0, 8), (7, 9), 1000)),
                                   "512/128@all": {**point(metrics((400, 800), (10, 12), (10, 20), 3300)),
                                                   "pd_multiplex": {"prefill_sms": 64.0, "decode_sms": 68.0,
                                                                    "split_changes": 2.0, "handoffs": 64.0,
                                                                    "whole_gpu_steps": 5.0},
                                                   "lane_work": {"prefill_tokens:112": 2048.0,
                                                                 "prefill_tokens:56": 30720.0,
                                                                 "decode_rows:76": 8128.0}}},
                        "goodput": {"goodput_rps": 8.0}, "skipped": []},
    }
    modes["multiplexed-slo"] = {"points": {"2048/256@4": point(metrics((70, 120), (9.5, 18), (9, 19), 960))},
                                "goodput": {"goodput_rps": 6.0}, "skipped": []}
    checks = multiplex.acceptance_checks(modes)
    assert checks["multiplexed-slo: goodput vs co-located"]["value"] == pytest.approx(1.5)
    assert checks["multiplexed-slo: ITL p99 / p50 at 2048/256@4"]["met"] is False  # 19 / 9
    assert checks["ITL p99 / p50 at 2048/256@4"]["value"] == pytest.approx(12 / 9)
    assert checks["ITL p99 / p50 at 2048/256@4"]["met"] is True
    assert checks["TTFT p50 vs co-located at 512/128@8"]["met"] is False  # 40 / 32 = 1.25
    assert checks["output tok/s vs co-located at 512/128@all"]["met"] is True
    assert checks["output tok/s vs co-located at 2048/256@all"] == {"value": None, "goal": ">= 1.0", "met": None}
    assert checks["goodput vs co-located"]["value"] == pytest.approx(2.0)
    text = multiplex.table({"modes": modes, "slo": {"ttft_ms": 1000.0, "tpot_ms": 20.0}, "checks": checks})
    assert "| 2048/256@4 | multiplexed | 40 | 80.0 / 150.0 | 9.0 / 10.0 | 9.0 / 12.0 | 950 | 0 |" in text
    assert "| colocated | 4 | 2048/256@all |" in text and "| multiplexed | 8 | - |" in text
    assert "| goodput vs co-located | 2.00 | >= 1.5 | yes |" in text
    assert "| 512/128@all | 64P/68D | 2 | 64 | 5 | 56P 30,720; 112P 2,048 | 76D 8,128 |" in text


def test_split_metrics_are_read_from_the_workers_exposition() -> None:
    text = "\n".join([
        "# TYPE hybridserve_worker_pd_multiplex_prefill_sms gauge",
        'hybridserve_worker_pd_multiplex_prefill_sms{role="decode"} 64.0',
        "# TYPE hybridserve_worker_pd_multiplex_split_changes counter",
        'hybridserve_worker_pd_multiplex_split_changes_total{role="decode"} 3.0',
        "# TYPE hybridserve_worker_pd_multiplex_prefill_tokens counter",
        'hybridserve_worker_pd_multiplex_prefill_tokens_total{role="decode",prefill_sms="56"} 4096.0',
        'hybridserve_worker_pd_multiplex_prefill_tokens_total{role="decode",prefill_sms="112"} 1024.0',
        "# TYPE hybridserve_worker_pd_multiplex_decode_rows counter",
        'hybridserve_worker_pd_multiplex_decode_rows_total{role="decode",decode_sms="76"} 900.0',
        "# TYPE hybridserve_worker_engine_steps counter",
        "hybridserve_worker_engine_steps_total 10.0", ""])
    before = multiplex.split_metrics(text)
    assert before == {"prefill_sms": 64.0, "split_changes": 3.0, "prefill_tokens:56": 4096.0,
                      "prefill_tokens:112": 1024.0, "decode_rows:76": 900.0}
    assert multiplex.split_metrics("") == {}
    after = {**before, "split_changes": 5.0, "prefill_tokens:56": 6144.0, "decode_rows:20": 64.0}
    assert multiplex.lane_work(before, after) == {"prefill_tokens:56": 2048.0, "decode_rows:20": 64.0}


def test_refuses_to_run_without_a_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                      tmp_path: Path) -> None:
    monkeypatch.setattr(multiplex, "gpu_check", lambda: "no CUDA GPU is visible")
    assert multiplex.main(["--out", str(tmp_path / "out")]) == 2
    assert "cannot run: no CUDA GPU is visible" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    import torch

    if not torch.cuda.is_available():
        assert multiplex.gpu_check() is not None


def test_points_past_the_mode_share_are_skipped_and_listed(tmp_path: Path) -> None:
    args, extra = multiplex.parse_args(["--out", str(tmp_path), "--", "--mamba-ssm-cache-dtype", "bfloat16"])
    run = multiplex.ModeRun("multiplexed", args, extra, tmp_path, share_s=30.0)
    assert run.flags[:1] == ["--pd-multiplex"] and run.flags[-2:] == ["--mamba-ssm-cache-dtype", "bfloat16"]
    assert "--gpu-memory-gb" in run.flags and "--max-num-seqs" in run.flags
    run.deadline = multiplex.time.monotonic() + 30.0
    assert run.fits(multiplex.Point(512, 128, math.inf, 64))  # all at once: no arrival span
    long = multiplex.Point(2048, 256, 4.0, 80)  # 20 s of arrivals + as long to drain: past the 30 s share
    assert not run.fits(long)
    assert run.measure(long) is None and run.skipped == ["2048/256@4"] and run.points == {}
    slo = multiplex.ModeRun("multiplexed-slo", args, extra, tmp_path, share_s=30.0)
    assert slo.flags[:3] == ["--pd-multiplex", "--pd-multiplex-tpot-slo-ms", "15"]


def test_the_result_names_the_tree_that_ran(tmp_path: Path) -> None:
    """A working tree copied onto an older checkout: HEAD names the old commit, the tree id names what ran (the id
    of the commit that holds those files); outside a git checkout, None."""
    def git(*command: str) -> str:
        env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ.get("PATH", "")}
        return subprocess.run(["git", *command], cwd=tmp_path, env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    assert multiplex.source_tree(tmp_path) is None
    git("init", "-q")
    (tmp_path / ".gitignore").write_text("out/\n")
    (tmp_path / "engine.py").write_text("STEP = 1\n")
    git("add", "-A")
    git("commit", "-qm", "old")
    old_tree = git("rev-parse", "HEAD^{tree}")
    (tmp_path / "engine.py").write_text("STEP = 2\n")  # the copied tree: a changed file, a new one, an ignored one
    (tmp_path / "lanes.py").write_text("LANES = 2\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "result.json").write_text("{}")
    ran = multiplex.source_tree(tmp_path)
    assert ran is not None and ran != old_tree
    assert git("status", "--porcelain") != ""  # the real index was not touched: the changes are still unstaged
    git("add", "-A")
    git("commit", "-qm", "new")
    assert git("rev-parse", "HEAD^{tree}") == ran
