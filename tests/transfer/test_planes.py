"""Every data plane gives the in-process tokens, and every fault on it fails cleanly and leaves no state.

CPU: gRPC and NIXL over UCX (TCP / shared memory). CUDA (GPU tests, skipped elsewhere): the CUDA IPC plane,
and gRPC with device landing. Workers run in this process (threads, real gRPC on loopback).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from concurrent import futures
from contextlib import nullcontext
from pathlib import Path

import grpc
import pytest
import torch
from checkpoints import nemotron_h, random_prompts

from hybridserve import LLM, SamplingParams
from hybridserve.decode_worker.worker import DecodeWorker
from hybridserve.engine.config import EngineConfig
from hybridserve.prefill_worker.worker import PrefillWorker
from hybridserve.proto import worker_pb2, worker_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.transfer.digest import device_digest
from hybridserve.transfer.manifest import StateHeader, build_manifest
from hybridserve.transfer.planes import CUDA_IPC, GRPC, NIXL, TCP, TransferConfig, nixl_available

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CUDA = torch.cuda.is_available()
# UCX (under NIXL) installs process-wide memory hooks; the NIXL cases run in a fresh interpreter of their own
# (test_nixl_plane_in_a_fresh_interpreter), as NIXL runs in real workers, not inside the long-lived pytest process
IN_NIXL_PROCESS = os.environ.get("HYBRIDSERVE_TEST_NIXL") == "1"


def _planes() -> list:
    planes = [pytest.param((GRPC, "cpu"), id="grpc-cpu"), pytest.param((TCP, "cpu"), id="tcp-cpu")]
    planes.append(pytest.param((NIXL, "cpu"), id="nixl-cpu", marks=pytest.mark.skipif(
        not (nixl_available() and IN_NIXL_PROCESS), reason="needs nixl; runs in its own interpreter")))
    gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
    planes += [pytest.param((CUDA_IPC, "cuda"), id="cuda_ipc-gpu", marks=[gpu, pytest.mark.gpu]),
               pytest.param((GRPC, "cuda"), id="grpc-gpu", marks=[gpu, pytest.mark.gpu]),
               pytest.param((TCP, "cuda"), id="tcp-gpu", marks=[gpu, pytest.mark.gpu])]
    return planes


def _decode_process(model_dir, config: EngineConfig, transfer: TransferConfig, conn) -> None:
    """A decode worker in its own process (CUDA IPC handles cannot be opened by the process that made them):
    sends its address, then answers "check" (pool invariants, idle) and "stop" on the pipe."""
    worker = DecodeWorker(model_dir, config, transfer=transfer)
    conn.send(worker.start())
    while conn.recv() != "stop":
        try:
            worker.loop.call(worker.engine.pool.check)
            conn.send("" if not worker.loop.call(worker.engine.has_unfinished) else "decode worker is not idle")
        except Exception as exc:  # reported to the test
            conn.send(f"{type(exc).__name__}: {exc}")
    worker.stop(grace=0)
    conn.send("stopped")


class RemoteDecode:
    """The decode side of a pair in a child process; on two GPUs it runs on the second."""

    def __init__(self, model_dir, config: EngineConfig, transfer: TransferConfig) -> None:
        import multiprocessing as mp
        import os

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if torch.cuda.device_count() >= 2:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in [1, 0, *range(2, torch.cuda.device_count())])
        try:
            self._process = ctx.Process(target=_decode_process, args=(model_dir, config, transfer, child), daemon=True)
            self._process.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        if not self._conn.poll(300):
            raise RuntimeError("the decode worker process did not start")
        self.address = self._conn.recv()

    def check(self) -> None:
        self._conn.send("check")
        problem = self._conn.recv()
        assert not problem, problem

    def stop(self, grace: float = 0) -> None:
        self._conn.send("stop")
        self._conn.poll(30)
        self._process.join(timeout=30)


class Pair:
    """One prefill and one decode worker that share exactly one data plane."""

    def __init__(self, plane: str, device: str) -> None:
        self.model_dir, _ = nemotron_h("M*-M*")
        self.config = EngineConfig(device=device, dtype="float32", prefill_chunk_size=16, max_num_seqs=8,
                                   gpu_memory_gb=1.0 if device == "cuda" else None)
        transfer = TransferConfig(planes=(plane,), staging_mb=8, grpc_chunk_bytes=4096, arena_wait_s=5.0)
        self.prefill = PrefillWorker(self.model_dir, self.config, transfer=transfer)
        self.prefill.start()
        if plane in (CUDA_IPC, NIXL, TCP):  # these planes cross a process boundary, as in deployments
            self.decode: DecodeWorker | RemoteDecode = RemoteDecode(self.model_dir, self.config, transfer)
        else:
            self.decode = DecodeWorker(self.model_dir, self.config, transfer=transfer)
            self.decode.start()
        self.plane = plane
        self.decode_stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(self.decode.address))
        self.prefill_stub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(self.prefill.address))

    def reserve(self, prompt: list[int], timeout_ms: int = 0) -> tuple[str, str]:
        request_id = uuid.uuid4().hex
        ticket = self.decode_stub.Reserve(worker_pb2.ReserveRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY), timeout_ms=timeout_ms,
        )).ticket
        return request_id, ticket

    def generate(self, prompt: list[int]) -> tuple[list[int], str]:
        """Reserve -> Prefill (which moves the state) -> stream tokens; returns (tokens, plane used)."""
        request_id, ticket = self.reserve(prompt)
        tokens = self.decode_stub.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket))
        reply = self.prefill_stub.Prefill(worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY),
            decode_address=self.decode.address, ticket=ticket,
        ), timeout=60)
        out = [t for event in tokens for t in event.token_ids]
        return out, reply.plane

    def check_pools(self) -> None:
        self.prefill.loop.call(self.prefill.engine.pool.check)
        assert not self.prefill.loop.call(self.prefill.engine.has_unfinished)
        if isinstance(self.decode, RemoteDecode):
            self.decode.check()
        else:
            self.decode.loop.call(self.decode.engine.pool.check)
            assert not self.decode.loop.call(self.decode.engine.has_unfinished)

    def stop(self) -> None:
        for w in (self.prefill, self.decode):
            w.stop(grace=0)


@pytest.fixture(scope="module", params=_planes())
def pair(request):
    plane, device = request.param
    p = Pair(plane, device)
    yield p
    p.stop()


def _reference(pair: Pair, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(pair.model_dir, device=pair.config.device, dtype=pair.config.dtype)
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


def test_plane_gives_in_process_tokens_concurrently(pair: Pair) -> None:
    prompts = random_prompts([1, 9, 17, 40, 64], vocab=128, seed=60)
    with futures.ThreadPoolExecutor(max_workers=5) as pool:
        results = list(pool.map(pair.generate, prompts))
    assert [r[1] for r in results] == [pair.plane] * len(prompts)
    assert [r[0] for r in results] == _reference(pair, prompts)
    assert pair.prefill.sender.arena.free_bytes() == pair.prefill.sender.arena.capacity  # every block back
    pair.check_pools()


def _staged_offer(pair: Pair, prompt: list[int], request_id: str, ticket: str):
    """A genuine staged state from the prefill engine and the message that offers it (or its stream)."""
    worker = pair.prefill
    rid = f"src-{request_id}"
    outs = list(worker.loop.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), rid, hold_state=True))
    specs = worker.loop.call(lambda: worker.engine.state_specs(len(prompt)))
    staged = worker.sender.stage(specs, worker.loop.call, lambda views: worker.engine.export_state(rid, views).parts)
    header = StateHeader(ticket, request_id, worker.fingerprint, len(prompt), outs[-1].token_ids[0], 0,
                         device_digest=device_digest(staged.block.data))
    return staged, header


def _offer(pair: Pair, staged, header: StateHeader, **manifest_changes) -> worker_pb2.StateOffer:
    manifest = build_manifest(header, staged.specs)
    for key, value in manifest_changes.items():
        setattr(manifest, key, value)
    source = pair.prefill.sender.sources[pair.plane]
    return worker_pb2.StateOffer(manifest=manifest, plane=pair.plane, source_id=source.source_id,
                                 source_descriptor=source.descriptor(), offset=staged.block.offset)


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "other-model", "dead-sender"])
def test_plane_faults_fail_cleanly_and_leave_no_state(pair: Pair, fault: str) -> None:
    prompt = random_prompts([40], vocab=128, seed=61)[0]
    request_id, ticket = pair.reserve(prompt)
    tokens = pair.decode_stub.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket))
    staged, header = _staged_offer(pair, prompt, request_id, ticket)
    try:
        if pair.plane == GRPC:
            _grpc_fault(pair, staged, header, fault)
        else:
            _offer_fault(pair, staged, header, fault)
    finally:
        pair.prefill.sender.arena.free(staged.block)
    assert list(tokens)[-1].finish_reason == "error"
    pair.check_pools()
    assert pair.generate(prompt)[0] == _reference(pair, [prompt])[0]  # nothing stale: the next one is exact


def _offer_fault(pair: Pair, staged, header: StateHeader, fault: str) -> None:
    changes: dict = {}
    code = {"corrupt": grpc.StatusCode.DATA_LOSS, "truncate": grpc.StatusCode.INVALID_ARGUMENT,
            "other-model": grpc.StatusCode.FAILED_PRECONDITION, "dead-sender": grpc.StatusCode.FAILED_PRECONDITION}
    if fault == "corrupt":
        staged.block.data[7] ^= 0x10  # the bytes change after the sender's digest
    elif fault == "truncate":
        changes["total_bytes"] = staged.block.nbytes - 1
    elif fault == "other-model":
        changes["model_fingerprint"] = "0" * 32
    offer = _offer(pair, staged, header, **changes)
    if fault == "dead-sender":  # a source that is gone: another arena's descriptor whose owner was closed
        offer.source_id, offer.source_descriptor = _dead_source(pair.plane, staged.block.data.device)
    source = pair.prefill.sender.sources[pair.plane]
    exposed = getattr(source, "exposed", None)  # the tcp plane serves only ranges on offer
    with exposed(staged.block.offset, staged.block.nbytes) if exposed else nullcontext():
        with pytest.raises(grpc.RpcError) as info:
            pair.decode_stub.OfferState(offer, timeout=60)
    assert info.value.code() == code[fault], info.value.details()


def _dead_source(plane: str, device: torch.device) -> tuple[str, bytes]:
    from hybridserve.transfer.arena import Arena

    arena = Arena(1 << 20, device)
    if plane == NIXL:
        from hybridserve.transfer.nixl_plane import NixlSource

        source = NixlSource(arena)
        descriptor = source.descriptor()
        source.close()
        del source
        return f"dead-{uuid.uuid4().hex}", descriptor
    if plane == TCP:
        from hybridserve.transfer.tcp_plane import TcpSource

        source = TcpSource(arena)
        descriptor = source.descriptor()
        source.close()  # nothing listens on its port any more
        return f"dead-{uuid.uuid4().hex}", descriptor
    return f"dead-{uuid.uuid4().hex}", b"not a CUDA IPC handle"


def _grpc_fault(pair: Pair, staged, header: StateHeader, fault: str) -> None:
    from hybridserve.transfer.grpc_sender import encode_state

    messages = list(encode_state(header, staged.specs, [p.cpu() for p in staged.parts], chunk_bytes=256))
    if fault == "corrupt":
        payload = bytearray(messages[2].data.payload)
        payload[0] ^= 0x01
        messages[2].data.payload = bytes(payload)
        code = grpc.StatusCode.DATA_LOSS
    elif fault == "truncate":
        messages, code = messages[:-4], grpc.StatusCode.DATA_LOSS
    elif fault == "other-model":
        messages[0].manifest.model_fingerprint = "0" * 32
        code = grpc.StatusCode.FAILED_PRECONDITION
    else:  # the sender dies mid-stream

        def dying():
            yield from messages[:3]
            raise ConnectionError("prefill worker died")

        with pytest.raises(grpc.RpcError):
            pair.decode_stub.PushState(dying(), timeout=30)
        return
    with pytest.raises(grpc.RpcError) as info:
        pair.decode_stub.PushState(iter(messages), timeout=30)
    assert info.value.code() == code, info.value.details()


def test_a_whole_state_stream_with_a_wrong_device_digest_is_refused(pair: Pair) -> None:
    """The end-to-end device digest catches what per-chunk crc32c cannot: bytes changed before sending."""
    if pair.plane != GRPC:
        pytest.skip("the gRPC plane's own check")
    from hybridserve.transfer.grpc_sender import encode_state

    prompt = random_prompts([24], vocab=128, seed=62)[0]
    request_id, ticket = pair.reserve(prompt)
    tokens = pair.decode_stub.StreamTokens(worker_pb2.StreamTokensRequest(request_id=request_id, ticket=ticket))
    staged, header = _staged_offer(pair, prompt, request_id, ticket)
    try:
        staged.block.data[3] ^= 0x01
        messages = list(encode_state(header, staged.specs, [p.cpu() for p in staged.parts], chunk_bytes=256))
    finally:
        pair.prefill.sender.arena.free(staged.block)
    with pytest.raises(grpc.RpcError) as info:
        pair.decode_stub.PushState(iter(messages), timeout=30)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert list(tokens)[-1].finish_reason == "error"
    pair.check_pools()


def test_a_state_larger_than_the_arena_goes_as_loose_copies_over_grpc() -> None:
    """No arena room is no failure: the state is exported as copies and streamed over gRPC."""
    from hybridserve.transfer.arena import ALIGN, Arena

    pair = Pair(GRPC, "cpu")
    try:
        pair.prefill.sender.arena = Arena(ALIGN)  # smaller than any state of this model
        prompt = random_prompts([30], vocab=128, seed=63)[0]
        tokens, plane = pair.generate(prompt)
        assert plane == GRPC and tokens == _reference(pair, [prompt])[0]
        pair.check_pools()
    finally:
        pair.stop()


@pytest.mark.skipif(not nixl_available() or IN_NIXL_PROCESS, reason="needs nixl (pip install 'hybridserve[nixl]')")
def test_nixl_plane_in_a_fresh_interpreter() -> None:
    """The NIXL-over-UCX cases above (tokens, every fault), run where UCX gets a process of its own."""
    env = {**os.environ, "HYBRIDSERVE_TEST_NIXL": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "nixl", __file__],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "5 passed" in done.stdout, done.stdout[-2000:]  # tokens + four faults
