"""Mutual TLS on internal gRPC: a worker with TLS on refuses a plaintext client (even one with the right token),
a client with a certificate of another CA and a client with no certificate (the handshake fails: UNAVAILABLE,
before any handler runs, nothing changes), and serves the router and the prefill -> decode transfers (same
greedy tokens as the offline engine) with the token still checked on top."""

from __future__ import annotations

import uuid

import grpc
import pytest
from router_cluster import ENGINE, GREEDY, Cluster
from tls_certs import make_tls

from hybridserve.engine.llm import LLM
from hybridserve.proto import common_pb2, worker_pb2
from hybridserve.proto.channels import internal_channel
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.proto.internal_auth import token_channel
from hybridserve.proto.internal_tls import InternalTlsConfig

TOKEN = "internal-" + "t" * 32
PROMPT = list(range(40, 90))


@pytest.fixture(scope="module")
def tls() -> InternalTlsConfig:
    return make_tls()


@pytest.fixture(scope="module")
def secured(model_dir, tls: InternalTlsConfig):
    c = Cluster(model_dir, num_prefill=1, num_decode=1, internal_token=TOKEN, internal_tls=tls)
    yield c
    c.stop()


def _health(channel: grpc.Channel, service: str) -> common_pb2.HealthResponse:
    ser, de = (lambda m: m.SerializeToString()), common_pb2.HealthResponse.FromString
    return channel.unary_unary(f"/hybridserve.v1.{service}/Health", ser, de)(common_pb2.HealthRequest(), timeout=10)


def _reserve(channel: grpc.Channel) -> None:
    ser, de = (lambda m: m.SerializeToString()), worker_pb2.ReserveResponse.FromString
    request = worker_pb2.ReserveRequest(request_id=uuid.uuid4().hex, prompt_token_ids=PROMPT,
                                        sampling=sampling_to_proto(GREEDY))
    channel.unary_unary("/hybridserve.v1.DecodeWorker/Reserve", ser, de)(request, timeout=10)


def test_tls_cluster_gives_the_offline_engines_greedy_tokens(secured: Cluster, model_dir) -> None:
    offline = LLM(model_dir, **ENGINE.__dict__).generate(sampling_params=GREEDY, prompt_token_ids=[PROMPT])[0]
    assert secured.generate(PROMPT) == offline.token_ids  # routed over TLS, state pushed prefill -> decode over TLS
    assert secured.orchestrator.recent_decisions[-1][1].prefill is not None  # it did go through the prefill worker
    assert all(h.subscriber is not None and h.subscriber.ready.is_set() for h in secured.orchestrator.workers.all())
    # no plaintext socket sessions beside TLS: the router's session with the worker is its gRPC stream
    assert secured.decode[0].health().session_port == 0


def test_wrong_clients_fail_the_handshake_and_change_nothing(secured: Cluster, tmp_path) -> None:
    other_ca = make_tls(tmp_path / "other", ca_name="another CA")
    decode, prefill = secured.decode[0], secured.prefill[0]
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=open(secured_tls(secured).ca_file, "rb").read())
    clients = {
        "plaintext": lambda address: token_channel(grpc.insecure_channel(address), TOKEN),
        "other CA": lambda address: internal_channel(address, TOKEN, tls=other_ca),
        "no client certificate": lambda address: token_channel(grpc.secure_channel(
            address, no_client_cert, options=secured_tls(secured).channel_options()), TOKEN),
    }
    for name, make in clients.items():
        for worker, service in ((decode, "DecodeWorker"), (prefill, "PrefillWorker")):
            channel = make(worker.address)
            with pytest.raises(grpc.RpcError) as info:
                _health(channel, service)
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED), name
            channel.close()
        channel = make(decode.address)
        with pytest.raises(grpc.RpcError):
            _reserve(channel)
        channel.close()
    assert not decode._reservations  # no Reserve went through
    assert secured.idle()
    secured.check_pools()
    assert secured.generate(PROMPT) == secured.generate(PROMPT)


def test_the_token_is_still_checked_over_tls(secured: Cluster, tls: InternalTlsConfig) -> None:
    right = internal_channel(secured.decode[0].address, TOKEN, tls=tls)
    assert _health(right, "DecodeWorker").role == "decode"
    wrong = internal_channel(secured.decode[0].address, "wrong-" + "t" * 32, tls=tls)
    with pytest.raises(grpc.RpcError) as info:
        _health(wrong, "DecodeWorker")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def secured_tls(cluster: Cluster) -> InternalTlsConfig:
    tls = cluster.decode[0]._internal_tls
    assert tls is not None
    return tls


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(ca_file="ca.crt"), "all three"),
    (dict(ca_file="a", cert_file="b", key_file="c", server_name=""), "server-name"),
])
def test_incomplete_tls_configs_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        InternalTlsConfig(**kwargs)


def test_an_unreadable_file_names_its_flag(tmp_path) -> None:
    tls = InternalTlsConfig(ca_file=str(tmp_path / "missing.crt"), cert_file="x", key_file="y")
    with pytest.raises(ValueError, match="--internal-tls-ca-file"):
        tls.server_credentials()
