"""Workers as separate processes and as Ray actors: same tokens as in-process; a killed actor comes back; the Ray
head a bare `serve` started ends with it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from checkpoints import nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.deploy.launch import WorkerOptions, start_worker_process
from hybridserve.deploy.ray_head import STOP_TIMEOUT_S
from hybridserve.engine.config import EngineConfig
from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.router.orchestrator import Orchestrator

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _reference(model_dir, prompts):
    return [o.token_ids for o in LLM(model_dir).generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


def _processes_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline, open(f"/proc/{entry}/stat") as stat:
                line, state = cmdline.read().decode(errors="replace"), stat.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in line and state != "Z":
            found.append(int(entry))
    return found


def _generate(orchestrator: Orchestrator, prompt: list[int]) -> list[int]:
    return [t for event in orchestrator.generate(prompt, GREEDY) for t in event.token_ids]


def test_process_workers_equal_in_process() -> None:
    model_dir, _ = nemotron_h("M*-M*")
    options = WorkerOptions(str(model_dir), EngineConfig(prefill_chunk_size=16))
    workers = [start_worker_process("prefill", "p0", options), start_worker_process("decode", "d0", options)]
    orchestrator = Orchestrator([workers[0].address], [workers[1].address])
    try:
        prompts = random_prompts([4, 25, 41], vocab=128, seed=50)
        assert [_generate(orchestrator, p) for p in prompts] == _reference(model_dir, prompts)
    finally:
        orchestrator.close()
        for w in workers:
            w.process.terminate()
            w.process.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_with_ray_actors_end_to_end() -> None:
    pytest.importorskip("ray")
    model_dir, _ = nemotron_h("M*-M*")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridserve", "serve", "--model", str(model_dir), "--prefill-workers", "1",
         "--decode-workers", "1", "--grpc-port", str(port), "--port", "0", "--prefill-chunk-size", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if "send requests to grpc://" in line:
                break
        assert any("send requests to" in line for line in lines), "".join(lines)[-3000:]
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        prompts = random_prompts([9, 30], vocab=128, seed=51)
        got = []
        for prompt in prompts:
            request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt), sampling=sampling_to_proto(GREEDY))
            got.append([t for r in stub.Generate(request, timeout=120) for t in r.event.token_ids])
        assert got == _reference(model_dir, prompts)
        bad = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 500]), sampling=sampling_to_proto(GREEDY))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(bad, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        head = re.search(r"local Ray head at \S+ \(its log: (\S+)/head\.log\)", "".join(lines))
        assert head is not None, "".join(lines)[-3000:]
        head_processes = _processes_with(head[1])
        assert head_processes, "no process of the local Ray head"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60 + STOP_TIMEOUT_S) == 0
        deadline = time.monotonic() + 30
        while _processes_with(head[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_with(head[1]) == [], "the Ray head outlived serve"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.slow
def test_killed_ray_actor_restarts_and_serves_again() -> None:
    ray = pytest.importorskip("ray")
    from hybridserve.deploy.options import ClusterOptions, WorkerOptions, new_internal_token
    from hybridserve.deploy.ray_workers import RayPlacement, actor_addresses, start_ray_workers
    from hybridserve.router.config import RouterOptions

    model_dir, _ = nemotron_h("M*-M*")
    ray.init(num_cpus=4, resources={"prefill": 1, "decode": 1}, include_dashboard=False, log_to_driver=False,
             namespace=f"test-{os.getpid()}")
    orchestrator: Orchestrator | None = None
    try:
        token = new_internal_token()  # the actors get it with their options; the orchestrator sends it
        options = ClusterOptions(router=RouterOptions(str(model_dir), internal_token=token),
                                 worker=WorkerOptions(str(model_dir), EngineConfig(prefill_chunk_size=16),
                                                      internal_token=token))
        actors = start_ray_workers(options, RayPlacement(max_restarts=2))
        orchestrator = Orchestrator(actor_addresses(actors["prefill"]), actor_addresses(actors["decode"]),
                                    internal_token=token)
        prompt = random_prompts([20], vocab=128, seed=52)[0]
        expected = _reference(model_dir, [prompt])[0]
        assert _generate(orchestrator, prompt) == expected
        decode = actors["decode"][0]
        old_address = actor_addresses([decode])[0]
        os.kill(ray.get(decode.pid.remote()), signal.SIGKILL)
        deadline = time.monotonic() + 180
        new_address = None
        while time.monotonic() < deadline:
            try:
                new_address = actor_addresses([decode], timeout=30)[0]
                if new_address != old_address:
                    break
            except ray.exceptions.RayActorError:
                pass
            time.sleep(0.5)
        assert new_address and new_address != old_address, "the decode actor did not come back"
        orchestrator.update_workers(actor_addresses(actors["prefill"]), [new_address])
        assert _generate(orchestrator, prompt) == expected
        decode_handle = orchestrator.workers.snapshot()[1][0]
        health = decode_handle.stub.Health(common_pb2.HealthRequest(), timeout=30)
        assert health.role == "decode" and health.status == "ok"
    finally:
        if orchestrator is not None:
            orchestrator.close()
        ray.shutdown()
