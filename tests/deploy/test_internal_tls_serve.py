"""`hybridserve serve --no-ray` with mutual TLS on internal gRPC, end to end: the router and the prefill and
decode worker processes all take the certificate flags, a completion comes back with the offline engine's
greedy tokens, and nothing logs the plaintext warning. Without the flags, workers bound beyond loopback get one
start-up line saying internal gRPC is plaintext (on 127.0.0.1 nothing is said)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
from router_cluster import tiny_model_dir
from tls_certs import make_tls

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.llm import LLM

ENGINE_FLAGS = ["--device", "cpu", "--prefill-chunk-size", "32", "--max-num-seqs", "4", "--max-model-len", "256"]
PROMPT = list(range(40, 90))


def _start(model_dir, log_dir, *flags: str) -> tuple[subprocess.Popen, str]:
    """`hybridserve serve --no-ray` on free ports; returns (process, HTTP base URL) once it serves."""
    argv = [sys.executable, "-m", "hybridserve", "serve", "--no-ray", "--model", str(model_dir), "--port", "0",
            "--grpc-port", "0", "--log-dir", str(log_dir), "--local-prefill-max-tokens", "0", *ENGINE_FLAGS, *flags]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 240
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError("serve exited:\n" + "".join(lines))
        lines.append(line)
        found = re.search(r"OpenAI API\s+(http://\S+)/v1", line)
        if found:
            process.banner = "".join(lines)  # type: ignore[attr-defined]
            return process, found.group(1)
    process.kill()
    raise TimeoutError("serve did not start:\n" + "".join(lines))


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.mark.slow
def test_serve_with_mutual_tls_gives_the_offline_tokens(tmp_path) -> None:
    model_dir = tiny_model_dir()
    tls = make_tls(tmp_path / "tls")
    process, base = _start(model_dir, tmp_path / "logs", "--internal-tls-ca-file", tls.ca_file,
                           "--internal-tls-cert-file", tls.cert_file, "--internal-tls-key-file", tls.key_file)
    try:
        reply = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": model_dir.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        engine = EngineConfig(prefill_chunk_size=32, max_num_seqs=4, max_model_len=256)
        offline = LLM(model_dir, **engine.__dict__).generate(
            sampling_params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), prompt_token_ids=[PROMPT])[0]
        assert reply.json()["choices"][0]["text"] == offline.text
        banner = process.banner  # type: ignore[attr-defined]
        assert "PLAINTEXT" not in banner and "INSECURE" not in banner
        worker_logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
        assert "prefill-0" in str(sorted((tmp_path / "logs").glob("*.log"))) and "PLAINTEXT" not in worker_logs
    finally:
        _stop(process)


@pytest.mark.slow
def test_serve_without_tls_beyond_loopback_says_plaintext_once(tmp_path) -> None:
    process, _ = _start(tiny_model_dir(), tmp_path / "logs", "--prefill-workers", "0", "--worker-host", "0.0.0.0")
    try:
        banner = process.banner  # type: ignore[attr-defined]
        assert banner.count("plaintext internal gRPC") == 1 and "workers bind 0.0.0.0" in banner, banner
    finally:
        _stop(process)
