"""`hybridserve serve` (worker processes) answers the OpenAI client and gRPC with the offline tokens, and a
SIGTERM during 20 streams drains: every stream finishes whole, then the process exits 0."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import openai
import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.proto import router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_openai_and_grpc(model_dir, tmp_path) -> None:
    grpc_port, http_port = _free_port(), _free_port()
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(  # vLLM's dialect: --port is HTTP, --grpc-port gRPC, --served-model-name
        [sys.executable, "-m", "hybridserve", "serve", "--no-ray", "--model", str(model_dir), "--prefill-workers",
         "1", "--decode-workers", "1", "--port", str(http_port), "--grpc-port", str(grpc_port),
         "--prefill-chunk-size", "32", "--max-model-len", "256", "--served-model-name", "served",
         "--log-dir", str(log_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if "grpc://" in line and "send requests" in line:
                break
        log = "".join(lines)
        found = re.search(r"OpenAI API\s+(http://\S+/v1)", log)
        assert found and "/targets" in log, log[-3000:]
        assert found.group(1) == f"http://127.0.0.1:{http_port}/v1"
        assert f"worker logs in {log_dir}" in log  # the banner names where each worker's log is
        assert sorted(f.name for f in log_dir.iterdir()) == ["decode-0.log", "prefill-0.log"]
        client = openai.OpenAI(base_url=found.group(1), api_key="unused", max_retries=0, timeout=60)
        prompt = list(range(30, 70))
        params = SamplingParams(max_tokens=6, temperature=0.0)
        expected = LLM(str(model_dir)).generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
        out = client.completions.create(model="served", prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == expected
        chunks = list(client.chat.completions.create(model="served", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 4
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt), sampling=sampling_to_proto(params))
        assert [t for r in stub.Generate(request, timeout=60) for t in r.event.token_ids] == expected
        _sigterm_during_streams_finishes_them(proc, client)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _sigterm_during_streams_finishes_them(proc: subprocess.Popen, client: openai.OpenAI, n: int = 20,
                                         max_tokens: int = 160) -> None:
    started = threading.Barrier(n + 1, timeout=120)
    counts: list[int | str] = [0] * n

    def stream(i: int) -> None:
        try:
            chunks = client.completions.create(model="served", prompt=[40 + i, 41, 42], max_tokens=max_tokens,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True,
                                                                                       "return_token_ids": True})
            first = True
            for chunk in chunks:
                if first:
                    first = False
                    started.wait()
                counts[i] += len(chunk.choices[0].model_extra.get("token_ids") or []) if chunk.choices else 0
        except Exception as exc:  # reported below, with the others' counts
            counts[i] = f"{type(exc).__name__}: {exc}"
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first tokens: now stop the server
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=180)
    assert counts == [max_tokens] * n, counts
    assert proc.wait(timeout=120) == 0
    rest = proc.stdout.read()
    assert "draining" in rest, rest[-2000:]


def test_old_flag_spellings_still_work_and_warn(capsys) -> None:
    from hybridserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--http-port", "9100", "--model-name", "m", "--grpc-port", "9101"])
    assert (args.http_port, args.grpc_port, args.model_name) == (9100, 9101, "m")
    err = capsys.readouterr().err
    assert "--http-port is deprecated" in err and "use --port" in err and "--model-name is deprecated" in err
    up = build_parser().parse_args(["up", "--address", "auto", "--port", "9200", "--served-model-name", "n"])
    assert (up.http_port, up.grpc_port, up.model_name) == (9200, 50051, "n")
    assert capsys.readouterr().err == ""


def test_version_flag(capsys) -> None:
    from hybridserve.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("hybridserve ")
