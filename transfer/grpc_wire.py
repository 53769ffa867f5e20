"""Fast path for PushState data chunks: protobuf wire format written and read by hand.

A `StateChunk{data: StateData{index, payload, crc32c}}` is encoded here with one copy of the payload and
decoded into a zero-copy view of it, instead of protobuf's three copies each way. The bytes on the wire are
exactly the protobuf encoding, so any client generated from worker.proto interoperates; manifest and trailer
messages go through protobuf as usual.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import grpc

from hybridserve.proto import worker_pb2, worker_pb2_grpc
from hybridserve.transfer.host_copy import new_message

PUSH_STATE_METHOD = "/hybridserve.v1.DecodeWorker/PushState"
_CHUNK_DATA_TAG = (2 << 3) | 2  # StateChunk.data, length-delimited
_INDEX_TAG, _PAYLOAD_TAG, _CRC_TAG = (1 << 3) | 0, (2 << 3) | 2, (3 << 3) | 5


@dataclass(frozen=True)
class RawStateData:
    """A decoded data chunk; `payload` views the received message's bytes."""

    index: int
    crc32c: int
    payload: memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint in a StateChunk")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode_data_chunk(index: int, crc32c: int, payload: bytes | memoryview) -> bytes:
    """The protobuf encoding of StateChunk{data{index, payload, crc32c}}, payload copied once (without the GIL)."""
    inner_head = bytes([_INDEX_TAG]) + _varint(index) + bytes([_PAYLOAD_TAG]) + _varint(len(payload))
    inner_tail = bytes([_CRC_TAG]) + struct.pack("<I", crc32c)
    inner_len = len(inner_head) + len(payload) + len(inner_tail)
    return new_message(bytes([_CHUNK_DATA_TAG]) + _varint(inner_len) + inner_head, payload, inner_tail)


def decode_state_chunk(raw: bytes) -> worker_pb2.StateChunk | RawStateData:
    """Data chunks by hand (zero-copy payload); manifest / trailer through protobuf."""
    if not raw or raw[0] != _CHUNK_DATA_TAG:
        return worker_pb2.StateChunk.FromString(raw)
    view = memoryview(raw)
    inner_len, pos = _read_varint(view, 1)
    end = pos + inner_len
    if end != len(view):
        raise ValueError("malformed StateChunk: data length does not match the message")
    index = crc = 0
    payload = view[0:0]
    while pos < end:
        tag, pos = _read_varint(view, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _read_varint(view, pos)
            if field == 1:
                index = value
        elif wire == 2:
            length, pos = _read_varint(view, pos)
            if field == 2:
                payload = view[pos : pos + length]
            pos += length
        elif wire == 5:
            if field == 3:
                crc = struct.unpack_from("<I", view, pos)[0]
            pos += 4
        elif wire == 1:
            pos += 8
        else:
            raise ValueError(f"malformed StateChunk: wire type {wire}")
    if pos != end:
        raise ValueError("malformed StateChunk: fields overrun the message")
    return RawStateData(index=index, crc32c=crc, payload=payload)


def _serialize(item: bytes | worker_pb2.StateChunk) -> bytes:
    return item if isinstance(item, bytes) else item.SerializeToString()


def push_state_stub(channel: grpc.Channel):
    """A PushState callable whose request iterator may yield pre-encoded bytes or StateChunk messages."""
    return channel.stream_unary(
        PUSH_STATE_METHOD, request_serializer=_serialize, response_deserializer=worker_pb2.PushStateResponse.FromString
    )


class _HandlerCapture:
    """Collects the handlers the generated `add_..._to_server` registers."""

    def __init__(self) -> None:
        self.handlers: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:  # noqa: ANN001 - grpc's interface
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = handlers


def add_decode_worker_servicer(servicer: worker_pb2_grpc.DecodeWorkerServicer, server: grpc.Server) -> None:
    """Register the DecodeWorker service with PushState's requests decoded by `decode_state_chunk`."""
    capture = _HandlerCapture()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, capture)
    handlers = dict(capture.handlers)
    handlers["PushState"] = grpc.stream_unary_rpc_method_handler(
        servicer.PushState,
        request_deserializer=decode_state_chunk,
        response_serializer=worker_pb2.PushStateResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("hybridserve.v1.DecodeWorker", handlers),))
    server.add_registered_method_handlers("hybridserve.v1.DecodeWorker", handlers)
