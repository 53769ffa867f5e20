"""Clients are isolated by identity: with several named API keys, one client's Abort cannot reach another's
request, an id in flight cannot be reused by the same client (ALREADY_EXISTS) but can by another, and
--max-per-client counts each key on its own; reflection needs no key. HTTP connections that send nothing or
send headers slowly are closed within their timeouts, and the per-peer connection cap holds."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from router_cluster import MODEL_NAME, Cluster

from hybridserve import SamplingParams
from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.router.auth import ApiKeys, parse_key
from hybridserve.router.config import AdmissionConfig

STEP_DELAY_S = 0.05  # a 200-token request runs ~10 s: long enough to act on it while it streams
HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# clients\nbob=key-b\n\n")
    c = Cluster(model_dir, num_prefill=0, num_decode=1, api_key=("alice=key-a",), api_key_file=str(key_file),
                admission=AdmissionConfig(max_running=8, max_per_client=1), header_timeout_s=HEADER_TIMEOUT_S,
                first_byte_timeout_s=HEADER_TIMEOUT_S, max_connections_per_peer=40)
    engine = c.decode[0].engine
    step = engine.step

    def slow_step(**kw):  # type: ignore[no-untyped-def]
        time.sleep(STEP_DELAY_S)
        return step(**kw)

    engine.step = slow_step
    yield c
    c.stop()


def stub_for(cluster: Cluster) -> tuple[grpc.Channel, router_pb2_grpc.RouterStub]:
    assert cluster.router is not None
    channel = grpc.insecure_channel(cluster.router.grpc_address, options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, router_pb2_grpc.RouterStub(channel)


def auth(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


LONG = router_pb2.GenerateRequest(request_id="job-1", text="a long one",
                                  sampling=sampling_to_proto(SamplingParams(max_tokens=200, temperature=0,
                                                                            ignore_eos=True)))


def test_key_entries_and_files_parse_with_names(tmp_path: Path) -> None:
    assert parse_key("alice=secret") == ("alice", "secret")
    name, key = parse_key("c2VjcmV0=")  # a base64 key's padding is not a name
    assert key == "c2VjcmV0=" and name.startswith("key-") and "c2Vj" not in name
    keys = ApiKeys.load(["a=1", "2"])
    assert keys.identity("Bearer 1", "10.0.0.1") == "key:a" and keys.identity("Bearer 3", "10.0.0.1") == "addr:10.0.0.1"
    assert ApiKeys().identity("Bearer 1", "10.0.0.1") == "addr:10.0.0.1"
    with pytest.raises(ValueError, match="cannot read the API key file"):
        ApiKeys.load(None, tmp_path / "missing")
    with pytest.raises(ValueError, match="given twice"):
        ApiKeys.load(["a=1", "b=1"])


def test_another_clients_abort_finds_nothing_and_the_owner_aborts(keyed: Cluster) -> None:
    channel, stub = stub_for(keyed)
    call = stub.Generate(LONG, timeout=60, metadata=auth("key-a"))
    assert next(call).event.request_id == "job-1"
    assert not stub.Abort(common_pb2.AbortRequest(request_id="job-1"), timeout=5, metadata=auth("key-b")).found
    next(call)  # still streaming
    assert stub.Abort(common_pb2.AbortRequest(request_id="job-1"), timeout=5, metadata=auth("key-a")).found
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    assert keyed.idle(timeout=5.0)
    channel.close()


def test_an_id_in_flight_is_refused_for_its_client_only_and_the_limit_is_per_key(keyed: Cluster) -> None:
    channel, stub = stub_for(keyed)
    first = stub.Generate(LONG, timeout=60, metadata=auth("key-a"))
    next(first)
    with pytest.raises(grpc.RpcError) as again:  # same client, same id
        list(stub.Generate(LONG, timeout=10, metadata=auth("key-a")))
    assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS
    other_id = router_pb2.GenerateRequest(request_id="job-2", text="x", sampling=LONG.sampling)
    with pytest.raises(grpc.RpcError) as limited:  # max_per_client=1: alice has one running
        list(stub.Generate(other_id, timeout=10, metadata=auth("key-a")))
    assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    short = router_pb2.GenerateRequest(request_id="job-1", text="x",
                                       sampling=sampling_to_proto(SamplingParams(max_tokens=3, temperature=0,
                                                                                 ignore_eos=True)))
    responses = list(stub.Generate(short, timeout=60, metadata=auth("key-b")))  # bob: same id, own limit
    assert responses[-1].usage.completion_tokens == 3
    http = httpx.post(keyed.base_url + "/v1/completions", headers={"authorization": "Bearer key-b"}, timeout=60,
                      json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert http.status_code == 200  # bob's HTTP request: alice's running one does not count against him
    first.cancel()
    assert keyed.idle(timeout=5.0)
    channel.close()


def test_reflection_needs_no_key_and_calls_do(keyed: Cluster) -> None:
    channel, stub = stub_for(keyed)
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                   timeout=10))
    names = {s.name for s in answers[0].list_services_response.service}
    assert "hybridserve.v1.Router" in names
    with pytest.raises(grpc.RpcError) as denied:
        stub.Health(common_pb2.HealthRequest(), timeout=5)
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.Health(common_pb2.HealthRequest(), timeout=5, metadata=auth("key-b")).role == "router"
    channel.close()


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float:
    """Seconds until the server closed `sock` (sending `trickle` a byte every 0.2 s meanwhile)."""
    start = time.monotonic()
    sock.settimeout(0.2)
    sent = 0
    while time.monotonic() - start < seconds:
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
            except OSError:
                return time.monotonic() - start
            sent += 1
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    return float("inf")


def test_silent_and_slow_header_connections_are_closed_within_the_timeouts(keyed: Cluster) -> None:
    assert keyed.router is not None
    host, port = keyed.router.http_address.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))
    slowloris = socket.create_connection((host, int(port)))
    headers = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 200
    assert closed_within(silent, 10 * HEADER_TIMEOUT_S) < 5 * HEADER_TIMEOUT_S
    assert closed_within(slowloris, 10 * HEADER_TIMEOUT_S, trickle=headers) < 5 * HEADER_TIMEOUT_S
    silent.close()
    slowloris.close()
    ok = httpx.get(keyed.base_url + "/health", timeout=10)  # the door still answers
    assert ok.status_code == 200


def test_a_silent_grpc_connection_is_closed_within_the_handshake_timeout(keyed: Cluster) -> None:
    assert keyed.router is not None
    host, port = keyed.router.grpc_address.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)))
    assert closed_within(silent, 10 * HEADER_TIMEOUT_S) < 5 * HEADER_TIMEOUT_S
    silent.close()


def test_connections_beyond_the_per_peer_cap_are_closed(keyed: Cluster) -> None:
    assert keyed.router is not None
    host, port = keyed.router.http_address.rsplit(":", 1)
    held = [socket.create_connection((host, int(port))) for _ in range(40)]
    time.sleep(0.2)
    extra = socket.create_connection((host, int(port)))
    assert closed_within(extra, 3.0) < 2.0
    for sock in held + [extra]:
        sock.close()
    time.sleep(0.3)
    assert httpx.get(keyed.base_url + "/health", timeout=10).status_code == 200
