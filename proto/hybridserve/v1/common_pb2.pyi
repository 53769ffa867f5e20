from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingOptions(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "min_tokens", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "structured_kind", "structured_spec", "structured_choices", "structured_field", "stop", "include_stop_str_in_output", "no_repeat_ngram_size")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_KIND_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_SPEC_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_CHOICES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    structured_kind: str
    structured_spec: str
    structured_choices: _containers.RepeatedScalarFieldContainer[str]
    structured_field: str
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    no_repeat_ngram_size: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., structured_kind: _Optional[str] = ..., structured_spec: _Optional[str] = ..., structured_choices: _Optional[_Iterable[str]] = ..., structured_field: _Optional[str] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., no_repeat_ngram_size: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "error", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "role", "model_fingerprint", "num_running", "num_waiting", "free_state_slots", "free_kv_pages", "queued_prefill_tokens", "worker_id", "block_size", "state_block", "metrics_port", "max_model_len", "total_state_slots", "total_kv_pages", "config_json", "sessions", "session_port", "max_running", "max_num_waiting")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_PORT_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    status: str
    role: str
    model_fingerprint: str
    num_running: int
    num_waiting: int
    free_state_slots: int
    free_kv_pages: int
    queued_prefill_tokens: int
    worker_id: str
    block_size: int
    state_block: int
    metrics_port: int
    max_model_len: int
    total_state_slots: int
    total_kv_pages: int
    config_json: str
    sessions: bool
    session_port: int
    max_running: int
    max_num_waiting: int
    def __init__(self, status: _Optional[str] = ..., role: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., free_state_slots: _Optional[int] = ..., free_kv_pages: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., worker_id: _Optional[str] = ..., block_size: _Optional[int] = ..., state_block: _Optional[int] = ..., metrics_port: _Optional[int] = ..., max_model_len: _Optional[int] = ..., total_state_slots: _Optional[int] = ..., total_kv_pages: _Optional[int] = ..., config_json: _Optional[str] = ..., sessions: _Optional[bool] = ..., session_port: _Optional[int] = ..., max_running: _Optional[int] = ..., max_num_waiting: _Optional[int] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("sequence", "kind", "block_hash", "parent_hash", "num_tokens")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        BLOCK_STORED: _ClassVar[CacheEvent.Kind]
        BLOCK_REMOVED: _ClassVar[CacheEvent.Kind]
        CHECKPOINT_STORED: _ClassVar[CacheEvent.Kind]
        CHECKPOINT_REMOVED: _ClassVar[CacheEvent.Kind]
    BLOCK_STORED: CacheEvent.Kind
    BLOCK_REMOVED: CacheEvent.Kind
    CHECKPOINT_STORED: CacheEvent.Kind
    CHECKPOINT_REMOVED: CacheEvent.Kind
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: CacheEvent.Kind
    block_hash: str
    parent_hash: str
    num_tokens: int
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[CacheEvent.Kind, str]] = ..., block_hash: _Optional[str] = ..., parent_hash: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class CacheEventsRequest(_message.Message):
    __slots__ = ("since_sequence", "snapshot")
    SINCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    since_sequence: int
    snapshot: bool
    def __init__(self, since_sequence: _Optional[int] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class CacheEventBatch(_message.Message):
    __slots__ = ("worker_id", "events", "next_sequence", "gap", "snapshot")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    events: _containers.RepeatedCompositeFieldContainer[CacheEvent]
    next_sequence: int
    gap: bool
    snapshot: bool
    def __init__(self, worker_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[CacheEvent, _Mapping]]] = ..., next_sequence: _Optional[int] = ..., gap: _Optional[bool] = ..., snapshot: _Optional[bool] = ...) -> None: ...
