from services.api.iserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerServiceGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "max_tokens", "sampling", "max_tokens_is_bound", "prompt_has_special_tokens", "max_prompt_tokens", "max_prompt_tokens_rule")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_IS_BOUND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_HAS_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_RULE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    max_tokens_is_bound: bool
    prompt_has_special_tokens: bool
    max_prompt_tokens: int
    max_prompt_tokens_rule: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens_is_bound: _Optional[bool] = ..., prompt_has_special_tokens: _Optional[bool] = ..., max_prompt_tokens: _Optional[int] = ..., max_prompt_tokens_rule: _Optional[str] = ...) -> None: ...

class WorkerServiceGenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timings", "prompt_tokens", "prefilled_with_tokens", "prompt_wait_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_WITH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    prompt_tokens: int
    prefilled_with_tokens: int
    prompt_wait_ms: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., prefilled_with_tokens: _Optional[int] = ..., prompt_wait_ms: _Optional[float] = ...) -> None: ...

class WorkerServiceSessionRequest(_message.Message):
    __slots__ = ("stream_id", "generate", "cancel")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    generate: WorkerServiceGenerateRequest
    cancel: WorkerServiceSessionCancel
    def __init__(self, stream_id: _Optional[int] = ..., generate: _Optional[_Union[WorkerServiceGenerateRequest, _Mapping]] = ..., cancel: _Optional[_Union[WorkerServiceSessionCancel, _Mapping]] = ...) -> None: ...

class WorkerServiceSessionCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerServiceSessionResponse(_message.Message):
    __slots__ = ("stream_id", "generate", "error")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    generate: WorkerServiceGenerateResponse
    error: WorkerServiceSessionError
    def __init__(self, stream_id: _Optional[int] = ..., generate: _Optional[_Union[WorkerServiceGenerateResponse, _Mapping]] = ..., error: _Optional[_Union[WorkerServiceSessionError, _Mapping]] = ...) -> None: ...

class WorkerServiceSessionError(_message.Message):
    __slots__ = ("status_code", "message", "reason")
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    status_code: int
    message: str
    reason: str
    def __init__(self, status_code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GetWorkerStatsRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GetWorkerStatsResponse(_message.Message):
    __slots__ = ("request_id", "deployment_id", "rank", "resident_bytes", "peak_memory_bytes", "requests_served", "tokens_generated", "busy_seconds", "active_requests", "prefill_layer_seconds", "prefill_layer_passes", "decode_layer_seconds", "decode_layer_passes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LAYER_PASSES_FIELD_NUMBER: _ClassVar[int]
    DECODE_LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_LAYER_PASSES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deployment_id: str
    rank: int
    resident_bytes: int
    peak_memory_bytes: int
    requests_served: int
    tokens_generated: int
    busy_seconds: float
    active_requests: int
    prefill_layer_seconds: float
    prefill_layer_passes: int
    decode_layer_seconds: float
    decode_layer_passes: int
    def __init__(self, request_id: _Optional[str] = ..., deployment_id: _Optional[str] = ..., rank: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., requests_served: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., active_requests: _Optional[int] = ..., prefill_layer_seconds: _Optional[float] = ..., prefill_layer_passes: _Optional[int] = ..., decode_layer_seconds: _Optional[float] = ..., decode_layer_passes: _Optional[int] = ...) -> None: ...
