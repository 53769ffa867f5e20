"""Fast tests of the serving benchmark's pieces: percentiles, TTFT / TPOT / ITL definitions on a scripted SSE
stream, the summary, Prometheus parsing, seeded arrivals and workloads, and CLI errors."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import random
import statistics
from pathlib import Path

import httpx
import numpy as np
import pytest
import serve as bench_serve
import serve_client
from serve_client import ClientConfig, request_body, stream_completion
from serve_metrics import (
    PREFIX_HIT_TOKENS,
    SPEC_ACCEPTED,
    SPEC_STEPS,
    RequestRecord,
    acceptance_length,
    distribution_ms,
    engine_loop,
    gc_pauses,
    parse_counters,
    percentile,
    summarize,
)
from serve_workloads import WorkloadConfig, arrival_offsets, build_workload, sample_len


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(1)
    for n in (1, 2, 5, 100):
        xs = [rng.uniform(0, 10) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_is_in_ms() -> None:
    d = distribution_ms([0.001, 0.002, 0.003])
    assert d["mean"] == pytest.approx(2.0) and d["p50"] == pytest.approx(2.0) and d["max"] == pytest.approx(3.0)
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_tpot_definition() -> None:
    r = RequestRecord(0, 0, prompt_len=10, max_tokens=5, success=True, ttft=0.1, e2e=0.5, output_tokens=5)
    assert r.tpot == pytest.approx((0.5 - 0.1) / 4)
    assert RequestRecord(0, 0, 10, 1, success=True, ttft=0.1, e2e=0.1, output_tokens=1).tpot is None
    assert RequestRecord(0, 0, 10, 5, success=False, ttft=0.1, e2e=0.5, output_tokens=5).tpot is None


GAP_S = 0.06


class FakeClock:
    """serve_client's perf_counter in these tests: it moves only when the scripted server says so, so the
    timing assertions hold on a loaded machine (no wall-clock time is measured)."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(serve_client, "time", fake)
    return fake


def _sse_transport(chunks: list[dict | str], status: int = 200, clock: FakeClock | None = None) -> httpx.MockTransport:
    """A server that streams `chunks` as SSE events GAP_S apart on `clock` (the first at once)."""

    async def body():
        for i, chunk in enumerate(chunks):
            if i and clock is not None:
                clock.now += GAP_S
            await asyncio.sleep(0)
            payload = chunk if isinstance(chunk, str) else json.dumps(chunk)
            yield f"data: {payload}\n\n".encode()

    async def handler(request: httpx.Request) -> httpx.Response:
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "queue full", "type": "x"}})
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def _choice(ids: list[int], finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids, "finish_reason": finish}], "usage": None}


async def _stream(transport: httpx.MockTransport) -> tuple[RequestRecord, list[int]]:
    cfg = ClientConfig(base_url="http://test", model="m")
    rec = RequestRecord(0, 0, prompt_len=4, max_tokens=4)
    async with httpx.AsyncClient(transport=transport) as client:
        answer = await stream_completion(client, cfg, [1, 2, 3, 4], 4, rec)
    return rec, answer


def test_stream_timing_ttft_itl_tpot_and_usage(clock: FakeClock) -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                                      "prompt_tokens_details": {"cached_tokens": 2}}}
    chunks = [_choice([7]), _choice([8, 9]), _choice([10], "length"), usage, "[DONE]"]
    rec, answer = asyncio.run(_stream(_sse_transport(chunks, clock=clock)))
    assert rec.success and rec.error is None and answer == [7, 8, 9, 10]
    assert rec.output_tokens == 4 and rec.cached_tokens == 2 and rec.finish_reason == "length"
    # one gap per token-carrying chunk after the first (the 2-token chunk is one gap); the usage and [DONE]
    # events come GAP_S apart after the last token and count in e2e only
    assert rec.ttft == 0.0 and rec.itl == pytest.approx([GAP_S, GAP_S])
    assert rec.e2e == pytest.approx(4 * GAP_S)
    assert rec.tpot == pytest.approx((rec.e2e - rec.ttft) / 3)


def test_stream_errors_are_recorded() -> None:
    rec, _ = asyncio.run(_stream(_sse_transport([], status=429)))
    assert not rec.success and rec.error == "HTTP 429: queue full"
    rec, _ = asyncio.run(_stream(_sse_transport([_choice([1]), {"error": {"message": "worker died"}}])))
    assert not rec.success and rec.error == "stream error: worker died"
    rec, _ = asyncio.run(_stream(_sse_transport(["[DONE]"])))
    assert not rec.success and rec.error == "no tokens streamed"


def test_request_body_is_a_streamed_token_id_completion() -> None:
    cfg = ClientConfig(base_url="u", model="m", extra_body={"top_k": 5})
    body = request_body(cfg, [1, 2], 7)
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 7 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True and body["top_k"] == 5


def _ok(prompt: int, out: int, ttft: float, e2e: float, cached: int | None) -> RequestRecord:
    return RequestRecord(0, 0, prompt, out, success=True, ttft=ttft, e2e=e2e, output_tokens=out, cached_tokens=cached,
                         itl=[(e2e - ttft) / max(out - 1, 1)] * (out - 1))


def test_summary_throughput_failures_prefix_and_acceptance() -> None:
    full = "HTTP 429: queue full"
    records = [_ok(100, 10, 0.1, 1.0, 50), _ok(100, 10, 0.3, 2.0, 0),
               RequestRecord(0, 1, 5, 5, error=full), RequestRecord(0, 2, 5, 5, error=full)]
    m = summarize(records, duration_s=2.0, counters_delta={SPEC_ACCEPTED: 30.0, SPEC_STEPS: 20.0})
    assert (m["completed"], m["failed"]) == (2, 2) and m["failure_reasons"] == {"HTTP 429: queue full": 2}
    assert m["request_throughput"] == pytest.approx(1.0) and m["output_throughput"] == pytest.approx(10.0)
    assert m["total_token_throughput"] == pytest.approx(110.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0) and m["e2e_ms"]["p50"] == pytest.approx(1500.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(statistics.mean([900 / 9, 1700 / 9]))
    assert m["prefix_hit_ratio"] == pytest.approx(0.25) and m["prefix_hit_source"] == "usage"
    assert m["spec_acceptance_length"] == pytest.approx(2.5)
    # no cached_tokens in the usage: the workers' counter
    m = summarize([_ok(100, 10, 0.1, 1.0, None)], 1.0, {PREFIX_HIT_TOKENS: 40.0})
    assert m["prefix_hit_ratio"] == pytest.approx(0.4) and m["prefix_hit_source"] == "prometheus"
    m = summarize([_ok(100, 10, 0.1, 1.0, None)], 1.0, None)
    assert m["prefix_hit_ratio"] is None and m["spec_acceptance_length"] is None


def test_acceptance_length_absent_or_idle_is_none() -> None:
    assert acceptance_length(None) is None
    assert acceptance_length({SPEC_ACCEPTED: 3.0}) is None
    assert acceptance_length({SPEC_ACCEPTED: 0.0, SPEC_STEPS: 0.0}) is None
    assert acceptance_length({SPEC_ACCEPTED: 0.0, SPEC_STEPS: 4.0}) == 1.0


def test_parse_counters_sums_label_sets() -> None:
    text = (
        "# HELP hybridserve_worker_spec_accepted_tokens Accepted draft tokens\n"
        "# TYPE hybridserve_worker_spec_accepted_tokens counter\n"
        'hybridserve_worker_spec_accepted_tokens_total{role="decode"} 12.0\n'
        'hybridserve_worker_spec_accepted_tokens_created{role="decode"} 1.7e9\n'
        'hybridserve_worker_spec_accepted_tokens_total{role="prefill"} 3.0\n'
        "# TYPE other gauge\nother 5\n"
    )
    assert parse_counters(text) == {SPEC_ACCEPTED: 15.0}


def test_decode_only_phases_are_kept_per_phase() -> None:
    name = "hybridserve_worker_engine_decode_only_phase_seconds"
    text = (
        f"# TYPE {name} counter\n"
        f'{name}_total{{role="decode",phase="wait"}} 3.0\n{name}_total{{role="decode",phase="update"}} 0.5\n'
        "# TYPE hybridserve_worker_engine_decode_only_steps counter\n"
        'hybridserve_worker_engine_decode_only_steps_total{role="decode"} 1000.0\n'
    )
    counters = parse_counters(text)
    assert counters == {f"{name}_total:wait": 3.0, f"{name}_total:update": 0.5,
                        "hybridserve_worker_engine_decode_only_steps_total": 1000.0}
    loop = engine_loop({**counters, "hybridserve_worker_engine_steps_total": 1200.0})
    assert loop["engine_decode_phase_ms_mean"] == pytest.approx({"wait": 3.0, "update": 0.5})


def test_gc_pauses_are_kept_per_generation_per_second() -> None:
    name = "hybridserve_worker_gc_pause_seconds"
    text = (f"# TYPE {name} counter\n{name}_total{{role=\"decode\",generation=\"0\"}} 0.2\n"
            f"{name}_total{{role=\"decode\",generation=\"2\"}} 0.4\n")
    counters = parse_counters(text)
    assert gc_pauses(counters, 20.0) == pytest.approx({"0": 10.0, "2": 20.0})
    assert gc_pauses(None, 20.0) is None and gc_pauses({}, 20.0) is None


def test_arrivals_are_seeded_poisson_fixed_or_at_once() -> None:
    a = arrival_offsets(2000, 10.0, "poisson", seed=3)
    assert a == arrival_offsets(2000, 10.0, "poisson", seed=3) and a != arrival_offsets(2000, 10.0, "poisson", seed=4)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.15)  # exponential: sd = mean
    assert arrival_offsets(4, 2.0, "fixed") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, "gamma")


def test_workloads_are_seeded_and_shaped() -> None:
    rng = random.Random(0)
    assert all(75 <= sample_len(rng, 100, 0.25) <= 125 for _ in range(500))
    cfg = WorkloadConfig(kind="random", num_prompts=50, input_len=40, output_len=8, range_ratio=0.5, seed=1)
    a, b = build_workload(cfg), build_workload(cfg)
    assert [s.turns[0].new_token_ids for s in a] == [s.turns[0].new_token_ids for s in b]
    assert all(20 <= len(s.turns[0].new_token_ids) <= 60 and 4 <= s.turns[0].max_tokens <= 12 for s in a)
    assert all(3 <= t < 256 for s in a for t in s.turns[0].new_token_ids)
    fresh = build_workload(WorkloadConfig(**{**cfg.__dict__, "id_seed": 1}))
    assert [len(s.turns[0].new_token_ids) for s in fresh] == [len(s.turns[0].new_token_ids) for s in a]
    assert [s.turns[0].new_token_ids for s in fresh] != [s.turns[0].new_token_ids for s in a]

    shared = build_workload(WorkloadConfig(kind="shared-prefix", num_prompts=12, num_groups=3, prefix_len=64,
                                           input_len=8, output_len=4))
    assert sorted(s.group for s in shared) == [0] * 4 + [1] * 4 + [2] * 4
    by_group = {s.group: s.prefix_token_ids for s in shared}
    assert len(by_group) == 3 and all(len(p) == 64 for p in by_group.values())
    assert all(s.prefix_token_ids == by_group[s.group] for s in shared)

    chat = build_workload(WorkloadConfig(kind="multi-turn", num_prompts=2, num_turns=3, input_len=10, output_len=5))
    assert [len(s.turns) for s in chat] == [3, 3] and chat[0].prefix_token_ids == []
    assert chat[0].max_context() == 3 * (10 + 5)
    with pytest.raises(ValueError):
        build_workload(WorkloadConfig(kind="nope"))


@pytest.mark.parametrize("argv, message", [
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--range-ratio", "1"], "--range-ratio"),
    (["--token-range", "9"], "--token-range"),
    (["--workload", "chat"], "--workload"),
    (["--extra-body", "{"], "--extra-body"),
    (["--labels", "a,b"], "--labels only goes with --compare"),
    (["--timeout", "0"], "--timeout"),
])
def test_bad_cli_input_is_an_argparse_error(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_serve.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_compare_needs_matching_labels(tmp_path, capsys) -> None:
    path = tmp_path / "a.json"
    path.write_text("{}")
    with pytest.raises(SystemExit):
        bench_serve.main(["--compare", str(path), "--labels", "a,b", "--result-dir", str(tmp_path)])
    assert "2 labels for 1" in capsys.readouterr().err


def test_serve_table_keys_a_workload_kind_apart_from_random_prompts(tmp_path: Path) -> None:
    import serve_table

    def write(name: str, rate: float) -> None:
        (tmp_path / f"{name}.json").write_text(json.dumps({"config": {"request_rate": rate}, "metrics": {"m": name}}))

    write("colocated-1gpu-128-64-rate2", 2)
    write("colocated-1gpu-multi-turn-128-64-rate2", 2)
    write("colocated-1gpu-nocache-shared-prefix-64-64-warm-rate8", 8)
    write("colocated-1gpu-1024-64-p2-rate8", 8)  # PASSES="p1 p2": each pass a row of its own
    plain = tmp_path / "colocated-1gpu-multi-turn-128-64-rate2.json"  # committed results keep large ones gzipped
    (tmp_path / (plain.name + ".gz")).write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    table = serve_table.load(tmp_path)
    assert table[("colocated-1gpu", "128/64")]["2"]["m"] == "colocated-1gpu-128-64-rate2"
    assert table[("colocated-1gpu", "multi-turn 128/64")]["2"]["m"] == "colocated-1gpu-multi-turn-128-64-rate2"
    assert ("colocated-1gpu-nocache (warm)", "shared-prefix 64/64") in table
    assert table[("colocated-1gpu (p2)", "1024/64")]["8"]["m"] == "colocated-1gpu-1024-64-p2-rate8"


def test_serve_table_sets_tpot_beside_the_offline_step_at_the_nearest_batch(tmp_path: Path) -> None:
    import serve_table

    metrics = {"completed": 96, "failed": 0, "request_throughput": 7.7, "output_throughput": 496,
               "ttft_ms": {"p50": 50.0, "p99": 100.0}, "tpot_ms": {"p50": 9.0, "p99": 15.0}, "itl_ms": {"p99": 60.0},
               "engine_step_ms_mean": 8.5, "engine_gap_ms_mean": 0.04, "engine_outputs_per_step": 4.3}
    (tmp_path / "colocated-1gpu-1024-64-rate8.json").write_text(
        json.dumps({"config": {"request_rate": 8}, "metrics": metrics}))
    (tmp_path / "colocated-1gpu-512-64-rate8.json").write_text(
        json.dumps({"config": {"request_rate": 8}, "metrics": metrics}))
    for batch, step in ((4, 6.0), (8, 6.5), (2, 5.0)):
        (tmp_path / f"one_batch-{batch}x1024.json").write_text(
            json.dumps({"batch": batch, "input_len": 1024, "output_len": 64, "decode_step_ms_p50": step}))
    offline = serve_table.offline_steps(tmp_path)
    assert offline == {(1024, 4): 6.0, (1024, 8): 6.5, (1024, 2): 5.0}
    assert serve_table.nearest_offline(offline, 1024, 6.0) == 6.5  # a tie takes the larger batch
    by_workload = {r["workload"]: r for r in serve_table.rows(serve_table.load(tmp_path), offline)}
    assert by_workload["1024/64"]["offline_step_ms"] == 6.0
    assert by_workload["1024/64"]["tpot_over_offline"] == 1.5
    assert by_workload["512/64"]["offline_step_ms"] is None  # no offline run of that input length
    assert serve_table.main([str(tmp_path)]) == 0
    assert "| 6.00 | 1.50 |" in (tmp_path / "table.md").read_text()
