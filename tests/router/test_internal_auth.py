"""Internal auth: with an internal token set, every method of both worker services refuses a call without it
or with a wrong one (UNAUTHENTICATED, before any handler runs: nothing changes), while the router and the
prefill worker's state transfers (which carry it) serve normally."""

from __future__ import annotations

import uuid

import grpc
import pytest
from router_cluster import GREEDY, Cluster

from hybridserve.proto import common_pb2, worker_pb2
from hybridserve.proto.convert import sampling_to_proto
from hybridserve.proto.internal_auth import TOKEN_METADATA, token_channel

TOKEN = "internal-" + "k" * 32


@pytest.fixture(scope="module")
def secured(model_dir):
    c = Cluster(model_dir, num_prefill=1, num_decode=1, internal_token=TOKEN)
    yield c
    c.stop()


def _requests(prompt: list[int]) -> dict[str, object]:
    """A meaningful request per input type: a refused call must not reserve, prefill or abort anything."""
    rid = uuid.uuid4().hex
    sampling = sampling_to_proto(GREEDY)
    return {
        "ReserveRequest": worker_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling),
        "PrefillRequest": worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling),
        "GenerateLocalRequest": worker_pb2.GenerateLocalRequest(request_id=rid, prompt_token_ids=prompt,
                                                                sampling=sampling),
        "AbortRequest": common_pb2.AbortRequest(request_id=rid),
        "SessionRequest": worker_pb2.SessionRequest(generate=worker_pb2.GenerateLocalRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling)),
    }


def _call(channel: grpc.Channel, service: str, method, request: object) -> None:
    """Call `method` of `service` generically (any streaming kind); raises grpc.RpcError."""
    from google.protobuf import message_factory

    path = f"/{service}/{method.name}"
    out_cls = message_factory.GetMessageClass(method.output_type)
    ser, de = (lambda m: m.SerializeToString()), out_cls.FromString
    if method.client_streaming:
        call = (channel.stream_stream if method.server_streaming else channel.stream_unary)(path, ser, de)
        result = call(iter([request]), timeout=10)
    else:
        call = (channel.unary_stream if method.server_streaming else channel.unary_unary)(path, ser, de)
        result = call(request, timeout=10)
    if method.server_streaming:
        list(result)


def test_every_worker_method_refuses_a_missing_or_wrong_token_and_changes_nothing(secured: Cluster) -> None:
    prompt = list(range(40, 80))
    assert secured.generate(prompt) == secured.generate(prompt)  # routed and transferred with the token
    decode, prefill = secured.decode[0], secured.prefill[0]
    requests = _requests(prompt)
    checked = []
    for worker in (prefill, decode):
        for token in (None, "wrong-" + "k" * 32):
            channel = token_channel(grpc.insecure_channel(worker.address), token)
            for service in worker_pb2.DESCRIPTOR.services_by_name.values():
                if (service.name == "PrefillWorker") != (worker is prefill):
                    continue
                for method in service.methods:
                    request = requests.get(method.input_type.name) or _empty(method.input_type)
                    with pytest.raises(grpc.RpcError) as info:
                        _call(channel, service.full_name, method, request)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (service.name, method.name)
                    checked.append(f"{service.name}.{method.name}")
            channel.close()
    assert len(set(checked)) == 14  # 10 decode + 4 prefill methods
    assert not decode._reservations  # no Reserve went through
    assert secured.idle()
    secured.check_pools()
    assert secured.generate(prompt) == secured.generate(prompt)


def test_a_right_token_is_served(secured: Cluster) -> None:
    """Through the token channel, and as plain metadata on a plain channel."""
    ser, de = (lambda m: m.SerializeToString()), common_pb2.HealthResponse.FromString
    channel = token_channel(grpc.insecure_channel(secured.decode[0].address), TOKEN)
    health = channel.unary_unary("/hybridserve.v1.DecodeWorker/Health", ser, de)(common_pb2.HealthRequest(), timeout=10)
    assert health.role == "decode"
    plain = grpc.insecure_channel(secured.prefill[0].address)
    health = plain.unary_unary("/hybridserve.v1.PrefillWorker/Health", ser, de)(
        common_pb2.HealthRequest(), metadata=[(TOKEN_METADATA, TOKEN)], timeout=10)
    assert health.role == "prefill"


def _empty(descriptor) -> object:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)()
