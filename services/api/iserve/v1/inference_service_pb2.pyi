from services.api.iserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "deployment_id", "prompt", "prompt_token_ids", "max_tokens", "sampling", "priority", "deadline_ms", "prompt_has_special_tokens", "max_tokens_default")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_HAS_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    deployment_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    priority: bool
    deadline_ms: int
    prompt_has_special_tokens: bool
    max_tokens_default: int
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., deployment_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[bool] = ..., deadline_ms: _Optional[int] = ..., prompt_has_special_tokens: _Optional[bool] = ..., max_tokens_default: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "prompt_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    prompt_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings", "deployment_id")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    deployment_id: str
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., deployment_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: TokenDelta
    final: GenerateFinal
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...

class GetServingStatsRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class DeploymentServingStats(_message.Message):
    __slots__ = ("deployment_id", "model_id", "requests_waiting", "requests_running", "requests_completed", "requests_failed", "ttft_p50_ms", "ttft_p95_ms", "slo_attained", "slo_missed")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P95_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINED_FIELD_NUMBER: _ClassVar[int]
    SLO_MISSED_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    model_id: str
    requests_waiting: int
    requests_running: int
    requests_completed: int
    requests_failed: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    slo_attained: int
    slo_missed: int
    def __init__(self, deployment_id: _Optional[str] = ..., model_id: _Optional[str] = ..., requests_waiting: _Optional[int] = ..., requests_running: _Optional[int] = ..., requests_completed: _Optional[int] = ..., requests_failed: _Optional[int] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p95_ms: _Optional[float] = ..., slo_attained: _Optional[int] = ..., slo_missed: _Optional[int] = ...) -> None: ...

class GetServingStatsResponse(_message.Message):
    __slots__ = ("request_id", "deployments")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deployments: _containers.RepeatedCompositeFieldContainer[DeploymentServingStats]
    def __init__(self, request_id: _Optional[str] = ..., deployments: _Optional[_Iterable[_Union[DeploymentServingStats, _Mapping]]] = ...) -> None: ...
