from hybridserve.proto.hybridserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingOptions
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("ticket", "model_fingerprint")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    model_fingerprint: str
    def __init__(self, ticket: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class StateManifest(_message.Message):
    __slots__ = ("ticket", "request_id", "model_fingerprint", "num_tokens", "first_token", "num_cached_tokens", "tensors", "total_bytes", "num_chunks", "chunk_bytes", "num_streams", "stream_index", "device_digest", "tail_in_trailer")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TAIL_IN_TRAILER_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    request_id: str
    model_fingerprint: str
    num_tokens: int
    first_token: int
    num_cached_tokens: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    num_chunks: int
    chunk_bytes: int
    num_streams: int
    stream_index: int
    device_digest: int
    tail_in_trailer: bool
    def __init__(self, ticket: _Optional[str] = ..., request_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_tokens: _Optional[int] = ..., first_token: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., num_streams: _Optional[int] = ..., stream_index: _Optional[int] = ..., device_digest: _Optional[int] = ..., tail_in_trailer: _Optional[bool] = ...) -> None: ...

class StateData(_message.Message):
    __slots__ = ("index", "payload", "crc32c")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    index: int
    payload: bytes
    crc32c: int
    def __init__(self, index: _Optional[int] = ..., payload: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class StateTrailer(_message.Message):
    __slots__ = ("digest", "tail")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    digest: int
    tail: StateTail
    def __init__(self, digest: _Optional[int] = ..., tail: _Optional[_Union[StateTail, _Mapping]] = ...) -> None: ...

class StateTail(_message.Message):
    __slots__ = ("first_token", "num_cached_tokens", "device_digest")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_cached_tokens: int
    device_digest: int
    def __init__(self, first_token: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., device_digest: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("manifest", "data", "trailer")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    manifest: StateManifest
    data: StateData
    trailer: StateTrailer
    def __init__(self, manifest: _Optional[_Union[StateManifest, _Mapping]] = ..., data: _Optional[_Union[StateData, _Mapping]] = ..., trailer: _Optional[_Union[StateTrailer, _Mapping]] = ...) -> None: ...

class PushStateResponse(_message.Message):
    __slots__ = ("committed", "bytes_received")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    bytes_received: int
    def __init__(self, committed: _Optional[bool] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class StateOffer(_message.Message):
    __slots__ = ("manifest", "plane", "source_id", "source_descriptor", "offset")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    manifest: StateManifest
    plane: str
    source_id: str
    source_descriptor: bytes
    offset: int
    def __init__(self, manifest: _Optional[_Union[StateManifest, _Mapping]] = ..., plane: _Optional[str] = ..., source_id: _Optional[str] = ..., source_descriptor: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class TransferInfoRequest(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: str
    def __init__(self, device: _Optional[str] = ...) -> None: ...

class TransferInfoResponse(_message.Message):
    __slots__ = ("planes", "host_id", "device")
    PLANES_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    planes: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    device: str
    def __init__(self, planes: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class StreamTokensRequest(_message.Message):
    __slots__ = ("request_id", "ticket")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ticket: str
    def __init__(self, request_id: _Optional[str] = ..., ticket: _Optional[str] = ...) -> None: ...

class GenerateLocalRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingOptions
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("generate", "abort", "stream_tokens")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    STREAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateLocalRequest
    abort: _common_pb2.AbortRequest
    stream_tokens: StreamTokensRequest
    def __init__(self, generate: _Optional[_Union[GenerateLocalRequest, _Mapping]] = ..., abort: _Optional[_Union[_common_pb2.AbortRequest, _Mapping]] = ..., stream_tokens: _Optional[_Union[StreamTokensRequest, _Mapping]] = ...) -> None: ...

class RequestRefused(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("events", "refused")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenEvent]
    refused: _containers.RepeatedCompositeFieldContainer[RequestRefused]
    def __init__(self, events: _Optional[_Iterable[_Union[_common_pb2.TokenEvent, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[RequestRefused, _Mapping]]] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("token", "version")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    token: str
    version: int
    def __init__(self, token: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class SessionHelloReply(_message.Message):
    __slots__ = ("code", "message", "worker_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    worker_id: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "ticket")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingOptions
    decode_address: str
    ticket: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., decode_address: _Optional[str] = ..., ticket: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "num_cached_tokens", "bytes_sent", "transfer_seconds", "plane")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_cached_tokens: int
    bytes_sent: int
    transfer_seconds: float
    plane: str
    def __init__(self, first_token: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., plane: _Optional[str] = ...) -> None: ...
