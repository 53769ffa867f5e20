"""`hybridserve serve --tensor-parallel-size 2` as a user runs it (worker processes, gloo on CPU): a decode
worker of 2 ranks (rank 0 serves gRPC and schedules, one follower process) behind the router, fed by a TP=1
prefill worker, answers the OpenAI client with the in-process TP=1 greedy tokens, then exits 0 on SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time

import openai

from hybridserve import LLM, SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_decode_tp2_fed_by_prefill_tp1(model_dir, tmp_path) -> None:
    http_port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridserve", "serve", "--no-ray", "--model", str(model_dir), "--prefill-workers",
         "1", "--decode-workers", "1", "--port", str(http_port), "--grpc-port", "0", "--prefill-chunk-size", "32",
         "--max-model-len", "256", "--tensor-parallel-size", "2", "--served-model-name", "served",
         "--prefill-worker-overrides", json.dumps({"tensor_parallel_size": 1}), "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if "send requests" in line:
                break
        log = "".join(lines)
        found = re.search(r"OpenAI API\s+(http://\S+/v1)", log)
        assert found, log[-3000:]
        decode_log = (tmp_path / "decode-0.log").read_text()
        assert re.search(r"tensor parallel: rank 0 of 2, follower pids \d+", decode_log), decode_log
        assert "tensor parallel" not in (tmp_path / "prefill-0.log").read_text()
        client = openai.OpenAI(base_url=found.group(1), api_key="unused", max_retries=0, timeout=120)
        prompts = [list(range(30, 70)), list(range(100, 107))]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        one = LLM(str(model_dir), prefill_chunk_size=32, max_model_len=256)
        for prompt in prompts:
            expected = one.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
            out = client.completions.create(model="served", prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
            assert out.choices[0].model_extra["token_ids"] == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
