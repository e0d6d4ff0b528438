from services.api.iserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROFILE_FORMAT_UNSPECIFIED: _ClassVar[ProfileFormat]
    PROFILE_FORMAT_MAVERIQ: _ClassVar[ProfileFormat]

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_REGISTERED: _ClassVar[ModelState]
    MODEL_STATE_PROFILING: _ClassVar[ModelState]
    MODEL_STATE_PROFILED: _ClassVar[ModelState]
    MODEL_STATE_FAILED: _ClassVar[ModelState]
PROFILE_FORMAT_UNSPECIFIED: ProfileFormat
PROFILE_FORMAT_MAVERIQ: ProfileFormat
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_REGISTERED: ModelState
MODEL_STATE_PROFILING: ModelState
MODEL_STATE_PROFILED: ModelState
MODEL_STATE_FAILED: ModelState

class ProfileFile(_message.Message):
    __slots__ = ("name", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: bytes
    def __init__(self, name: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...

class ModelShape(_message.Message):
    __slots__ = ("family", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "dtype", "parameter_count", "weight_bytes")
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    TIE_WORD_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    family: _common_pb2.ModelFamily
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: _common_pb2.Precision
    parameter_count: int
    weight_bytes: int
    def __init__(self, family: _Optional[_Union[_common_pb2.ModelFamily, str]] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., tie_word_embeddings: _Optional[bool] = ..., dtype: _Optional[_Union[_common_pb2.Precision, str]] = ..., parameter_count: _Optional[int] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("model_id", "checkpoint_path", "shape", "variants", "state", "state_reason", "created_at_unix_ms", "accuracy_score", "owner")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_SCORE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    checkpoint_path: str
    shape: ModelShape
    variants: _containers.RepeatedCompositeFieldContainer[_common_pb2.CompressionVariant]
    state: ModelState
    state_reason: str
    created_at_unix_ms: int
    accuracy_score: float
    owner: str
    def __init__(self, model_id: _Optional[str] = ..., checkpoint_path: _Optional[str] = ..., shape: _Optional[_Union[ModelShape, _Mapping]] = ..., variants: _Optional[_Iterable[_Union[_common_pb2.CompressionVariant, _Mapping]]] = ..., state: _Optional[_Union[ModelState, str]] = ..., state_reason: _Optional[str] = ..., created_at_unix_ms: _Optional[int] = ..., accuracy_score: _Optional[float] = ..., owner: _Optional[str] = ...) -> None: ...

class RegisterModelRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "checkpoint_path", "variants", "accuracy_score", "skip_profiling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_SCORE_FIELD_NUMBER: _ClassVar[int]
    SKIP_PROFILING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    checkpoint_path: str
    variants: _containers.RepeatedCompositeFieldContainer[_common_pb2.CompressionVariant]
    accuracy_score: float
    skip_profiling: bool
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., checkpoint_path: _Optional[str] = ..., variants: _Optional[_Iterable[_Union[_common_pb2.CompressionVariant, _Mapping]]] = ..., accuracy_score: _Optional[float] = ..., skip_profiling: _Optional[bool] = ...) -> None: ...

class RegisterModelResponse(_message.Message):
    __slots__ = ("request_id", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: Model
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[_Union[Model, _Mapping]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("request_id", "model_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...

class GetModelResponse(_message.Message):
    __slots__ = ("request_id", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: Model
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[_Union[Model, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("request_id", "models")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, request_id: _Optional[str] = ..., models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class DeleteModelRequest(_message.Message):
    __slots__ = ("request_id", "model_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...

class DeleteModelResponse(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WatchModelRequest(_message.Message):
    __slots__ = ("request_id", "model_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...

class WatchModelResponse(_message.Message):
    __slots__ = ("request_id", "state", "runs_done", "runs_total", "current", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNS_DONE_FIELD_NUMBER: _ClassVar[int]
    RUNS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: ModelState
    runs_done: int
    runs_total: int
    current: str
    message: str
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., runs_done: _Optional[int] = ..., runs_total: _Optional[int] = ..., current: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ImportProfilesRequest(_message.Message):
    __slots__ = ("request_id", "format", "hardware_type", "files", "model_configs")
    class ModelConfigsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_TYPE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    format: ProfileFormat
    hardware_type: str
    files: _containers.RepeatedCompositeFieldContainer[ProfileFile]
    model_configs: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., format: _Optional[_Union[ProfileFormat, str]] = ..., hardware_type: _Optional[str] = ..., files: _Optional[_Iterable[_Union[ProfileFile, _Mapping]]] = ..., model_configs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ImportProfilesResponse(_message.Message):
    __slots__ = ("request_id", "model_ids", "measurements_imported", "skipped", "notes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    MEASUREMENTS_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    measurements_imported: int
    skipped: _containers.RepeatedScalarFieldContainer[str]
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model_ids: _Optional[_Iterable[str]] = ..., measurements_imported: _Optional[int] = ..., skipped: _Optional[_Iterable[str]] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class GetProfileRequest(_message.Message):
    __slots__ = ("request_id", "model_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...

class ProfileMeasurement(_message.Message):
    __slots__ = ("variant_name", "num_layers", "full_model", "config", "stage_layers", "input_tokens", "output_tokens", "ttft_ms", "tpot_ms", "latency_ms", "peak_memory_bytes_per_rank", "repetitions", "hardware_type", "ttft_layer_ms", "tpot_layer_ms", "layer_weight_bytes", "layer_kv_bytes_per_token", "source_file", "other_cpu_share")
    VARIANT_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FULL_MODEL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    STAGE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    REPETITIONS_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_TYPE_FIELD_NUMBER: _ClassVar[int]
    TTFT_LAYER_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_LAYER_MS_FIELD_NUMBER: _ClassVar[int]
    LAYER_WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FILE_FIELD_NUMBER: _ClassVar[int]
    OTHER_CPU_SHARE_FIELD_NUMBER: _ClassVar[int]
    variant_name: str
    num_layers: int
    full_model: bool
    config: _common_pb2.DeploymentConfig
    stage_layers: _containers.RepeatedScalarFieldContainer[int]
    input_tokens: int
    output_tokens: int
    ttft_ms: float
    tpot_ms: float
    latency_ms: float
    peak_memory_bytes_per_rank: _containers.RepeatedScalarFieldContainer[int]
    repetitions: int
    hardware_type: str
    ttft_layer_ms: float
    tpot_layer_ms: float
    layer_weight_bytes: float
    layer_kv_bytes_per_token: float
    source_file: str
    other_cpu_share: float
    def __init__(self, variant_name: _Optional[str] = ..., num_layers: _Optional[int] = ..., full_model: _Optional[bool] = ..., config: _Optional[_Union[_common_pb2.DeploymentConfig, _Mapping]] = ..., stage_layers: _Optional[_Iterable[int]] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., latency_ms: _Optional[float] = ..., peak_memory_bytes_per_rank: _Optional[_Iterable[int]] = ..., repetitions: _Optional[int] = ..., hardware_type: _Optional[str] = ..., ttft_layer_ms: _Optional[float] = ..., tpot_layer_ms: _Optional[float] = ..., layer_weight_bytes: _Optional[float] = ..., layer_kv_bytes_per_token: _Optional[float] = ..., source_file: _Optional[str] = ..., other_cpu_share: _Optional[float] = ...) -> None: ...

class ProfilingCost(_message.Message):
    __slots__ = ("wall_time_ms", "device_seconds", "peak_device_memory_bytes")
    WALL_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEAK_DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    wall_time_ms: float
    device_seconds: float
    peak_device_memory_bytes: int
    def __init__(self, wall_time_ms: _Optional[float] = ..., device_seconds: _Optional[float] = ..., peak_device_memory_bytes: _Optional[int] = ...) -> None: ...

class GetProfileResponse(_message.Message):
    __slots__ = ("request_id", "model_id", "measurements", "cost", "skipped")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MEASUREMENTS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    measurements: _containers.RepeatedCompositeFieldContainer[ProfileMeasurement]
    cost: ProfilingCost
    skipped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., measurements: _Optional[_Iterable[_Union[ProfileMeasurement, _Mapping]]] = ..., cost: _Optional[_Union[ProfilingCost, _Mapping]] = ..., skipped: _Optional[_Iterable[str]] = ...) -> None: ...
