from services.api.iserve.v1 import common_pb2 as _common_pb2
from services.api.iserve.v1 import model_service_pb2 as _model_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_KIND_UNSPECIFIED: _ClassVar[EngineKind]
    ENGINE_KIND_PYTORCH: _ClassVar[EngineKind]
    ENGINE_KIND_TENSORRT_LLM: _ClassVar[EngineKind]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
ENGINE_KIND_UNSPECIFIED: EngineKind
ENGINE_KIND_PYTORCH: EngineKind
ENGINE_KIND_TENSORRT_LLM: EngineKind
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_STOPPED: WorkerState
WORKER_STATE_FAILED: WorkerState

class WorkerSpec(_message.Message):
    __slots__ = ("rank", "device_id", "stage", "tensor_rank", "first_layer", "layer_count")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    device_id: str
    stage: int
    tensor_rank: int
    first_layer: int
    layer_count: int
    def __init__(self, rank: _Optional[int] = ..., device_id: _Optional[str] = ..., stage: _Optional[int] = ..., tensor_rank: _Optional[int] = ..., first_layer: _Optional[int] = ..., layer_count: _Optional[int] = ...) -> None: ...

class StartWorkersRequest(_message.Message):
    __slots__ = ("request_id", "deployment_id", "checkpoint_path", "config", "workers", "rendezvous_address", "max_seq_len", "engine", "ready_timeout_ms", "expected_shape", "node_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    READY_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SHAPE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deployment_id: str
    checkpoint_path: str
    config: _common_pb2.DeploymentConfig
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSpec]
    rendezvous_address: str
    max_seq_len: int
    engine: EngineKind
    ready_timeout_ms: int
    expected_shape: _model_service_pb2.ModelShape
    node_id: str
    def __init__(self, request_id: _Optional[str] = ..., deployment_id: _Optional[str] = ..., checkpoint_path: _Optional[str] = ..., config: _Optional[_Union[_common_pb2.DeploymentConfig, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerSpec, _Mapping]]] = ..., rendezvous_address: _Optional[str] = ..., max_seq_len: _Optional[int] = ..., engine: _Optional[_Union[EngineKind, str]] = ..., ready_timeout_ms: _Optional[int] = ..., expected_shape: _Optional[_Union[_model_service_pb2.ModelShape, _Mapping]] = ..., node_id: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("deployment_id", "rank", "device_id", "pid", "address", "state", "exit_code", "reason", "resident_bytes")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    rank: int
    device_id: str
    pid: int
    address: str
    state: WorkerState
    exit_code: int
    reason: str
    resident_bytes: int
    def __init__(self, deployment_id: _Optional[str] = ..., rank: _Optional[int] = ..., device_id: _Optional[str] = ..., pid: _Optional[int] = ..., address: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ..., resident_bytes: _Optional[int] = ...) -> None: ...

class StartWorkersResponse(_message.Message):
    __slots__ = ("request_id", "workers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, request_id: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class StopWorkersRequest(_message.Message):
    __slots__ = ("request_id", "deployment_id", "lost_rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    LOST_RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deployment_id: str
    lost_rank: bool
    def __init__(self, request_id: _Optional[str] = ..., deployment_id: _Optional[str] = ..., lost_rank: _Optional[bool] = ...) -> None: ...

class StopWorkersResponse(_message.Message):
    __slots__ = ("request_id", "workers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, request_id: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("request_id", "deployment_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deployment_id: str
    def __init__(self, request_id: _Optional[str] = ..., deployment_id: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("request_id", "workers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, request_id: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class RunProfilingJobRequest(_message.Message):
    __slots__ = ("request_id", "checkpoint_path", "config", "workers", "input_tokens", "output_tokens", "warmup_runs", "timed_runs", "extra_input_tokens", "model_layers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_RUNS_FIELD_NUMBER: _ClassVar[int]
    TIMED_RUNS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    checkpoint_path: str
    config: _common_pb2.DeploymentConfig
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSpec]
    input_tokens: int
    output_tokens: _containers.RepeatedScalarFieldContainer[int]
    warmup_runs: int
    timed_runs: int
    extra_input_tokens: _containers.RepeatedScalarFieldContainer[int]
    model_layers: int
    def __init__(self, request_id: _Optional[str] = ..., checkpoint_path: _Optional[str] = ..., config: _Optional[_Union[_common_pb2.DeploymentConfig, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerSpec, _Mapping]]] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[_Iterable[int]] = ..., warmup_runs: _Optional[int] = ..., timed_runs: _Optional[int] = ..., extra_input_tokens: _Optional[_Iterable[int]] = ..., model_layers: _Optional[int] = ...) -> None: ...

class RunProfilingJobResponse(_message.Message):
    __slots__ = ("request_id", "runs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    runs: _containers.RepeatedCompositeFieldContainer[ProfiledRun]
    def __init__(self, request_id: _Optional[str] = ..., runs: _Optional[_Iterable[_Union[ProfiledRun, _Mapping]]] = ...) -> None: ...

class ProfiledRun(_message.Message):
    __slots__ = ("output_tokens", "ttft_ms", "tpot_ms", "latency_ms", "peak_memory_bytes_per_rank", "ttft_layer_ms", "tpot_layer_ms", "input_tokens", "other_cpu_share")
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    TTFT_LAYER_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_LAYER_MS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OTHER_CPU_SHARE_FIELD_NUMBER: _ClassVar[int]
    output_tokens: int
    ttft_ms: float
    tpot_ms: float
    latency_ms: float
    peak_memory_bytes_per_rank: _containers.RepeatedScalarFieldContainer[int]
    ttft_layer_ms: float
    tpot_layer_ms: float
    input_tokens: int
    other_cpu_share: float
    def __init__(self, output_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., latency_ms: _Optional[float] = ..., peak_memory_bytes_per_rank: _Optional[_Iterable[int]] = ..., ttft_layer_ms: _Optional[float] = ..., tpot_layer_ms: _Optional[float] = ..., input_tokens: _Optional[int] = ..., other_cpu_share: _Optional[float] = ...) -> None: ...
