from services.api.iserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Workload(_message.Message):
    __slots__ = ("input_tokens", "output_tokens", "batch_size")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    output_tokens: int
    batch_size: int
    def __init__(self, input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class ConfigEstimate(_message.Message):
    __slots__ = ("config", "memory_total_bytes", "memory_per_device_bytes", "kv_cache_bytes", "ttft_ms", "tpot_ms", "latency_ms", "cost_memory_latency", "cost_memory", "cost_device_hours", "accuracy_score", "throughput_tokens_per_second_per_device", "batch_measured", "communication_unprofiled", "fits_device_memory")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PER_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    COST_MEMORY_LATENCY_FIELD_NUMBER: _ClassVar[int]
    COST_MEMORY_FIELD_NUMBER: _ClassVar[int]
    COST_DEVICE_HOURS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_SCORE_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_TOKENS_PER_SECOND_PER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    BATCH_MEASURED_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATION_UNPROFILED_FIELD_NUMBER: _ClassVar[int]
    FITS_DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    config: _common_pb2.DeploymentConfig
    memory_total_bytes: int
    memory_per_device_bytes: int
    kv_cache_bytes: int
    ttft_ms: float
    tpot_ms: float
    latency_ms: float
    cost_memory_latency: float
    cost_memory: float
    cost_device_hours: float
    accuracy_score: float
    throughput_tokens_per_second_per_device: float
    batch_measured: bool
    communication_unprofiled: bool
    fits_device_memory: bool
    def __init__(self, config: _Optional[_Union[_common_pb2.DeploymentConfig, _Mapping]] = ..., memory_total_bytes: _Optional[int] = ..., memory_per_device_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., latency_ms: _Optional[float] = ..., cost_memory_latency: _Optional[float] = ..., cost_memory: _Optional[float] = ..., cost_device_hours: _Optional[float] = ..., accuracy_score: _Optional[float] = ..., throughput_tokens_per_second_per_device: _Optional[float] = ..., batch_measured: _Optional[bool] = ..., communication_unprofiled: _Optional[bool] = ..., fits_device_memory: _Optional[bool] = ...) -> None: ...

class EstimateConfigsRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "hardware_type", "workload", "device_count", "device_memory_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_TYPE_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    hardware_type: str
    workload: Workload
    device_count: int
    device_memory_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., hardware_type: _Optional[str] = ..., workload: _Optional[_Union[Workload, _Mapping]] = ..., device_count: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ...) -> None: ...

class EstimateConfigsResponse(_message.Message):
    __slots__ = ("request_id", "estimates", "notes", "device_memory_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    estimates: _containers.RepeatedCompositeFieldContainer[ConfigEstimate]
    notes: _containers.RepeatedScalarFieldContainer[str]
    device_memory_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., estimates: _Optional[_Iterable[_Union[ConfigEstimate, _Mapping]]] = ..., notes: _Optional[_Iterable[str]] = ..., device_memory_bytes: _Optional[int] = ...) -> None: ...

class RankedConfig(_message.Message):
    __slots__ = ("rank", "estimate", "meets_intent", "shortfall")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    MEETS_INTENT_FIELD_NUMBER: _ClassVar[int]
    SHORTFALL_FIELD_NUMBER: _ClassVar[int]
    rank: int
    estimate: ConfigEstimate
    meets_intent: bool
    shortfall: str
    def __init__(self, rank: _Optional[int] = ..., estimate: _Optional[_Union[ConfigEstimate, _Mapping]] = ..., meets_intent: _Optional[bool] = ..., shortfall: _Optional[str] = ...) -> None: ...

class RankConfigsRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "hardware_type", "workload", "device_count", "intent", "device_memory_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_TYPE_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    INTENT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    hardware_type: str
    workload: Workload
    device_count: int
    intent: _common_pb2.Intent
    device_memory_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., hardware_type: _Optional[str] = ..., workload: _Optional[_Union[Workload, _Mapping]] = ..., device_count: _Optional[int] = ..., intent: _Optional[_Union[_common_pb2.Intent, _Mapping]] = ..., device_memory_bytes: _Optional[int] = ...) -> None: ...

class RankConfigsResponse(_message.Message):
    __slots__ = ("request_id", "ranked", "note")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RANKED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ranked: _containers.RepeatedCompositeFieldContainer[RankedConfig]
    note: str
    def __init__(self, request_id: _Optional[str] = ..., ranked: _Optional[_Iterable[_Union[RankedConfig, _Mapping]]] = ..., note: _Optional[str] = ...) -> None: ...

class Calibration(_message.Message):
    __slots__ = ("hardware_type", "alpha", "beta", "gamma", "delta", "extra_terms", "provenance", "fitted_at_unix_ms", "fit_error_percent")
    class ExtraTermsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    HARDWARE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    EXTRA_TERMS_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    FITTED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FIT_ERROR_PERCENT_FIELD_NUMBER: _ClassVar[int]
    hardware_type: str
    alpha: float
    beta: float
    gamma: float
    delta: float
    extra_terms: _containers.ScalarMap[str, float]
    provenance: str
    fitted_at_unix_ms: int
    fit_error_percent: float
    def __init__(self, hardware_type: _Optional[str] = ..., alpha: _Optional[float] = ..., beta: _Optional[float] = ..., gamma: _Optional[float] = ..., delta: _Optional[float] = ..., extra_terms: _Optional[_Mapping[str, float]] = ..., provenance: _Optional[str] = ..., fitted_at_unix_ms: _Optional[int] = ..., fit_error_percent: _Optional[float] = ...) -> None: ...

class GetCalibrationRequest(_message.Message):
    __slots__ = ("request_id", "hardware_type")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_TYPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    hardware_type: str
    def __init__(self, request_id: _Optional[str] = ..., hardware_type: _Optional[str] = ...) -> None: ...

class GetCalibrationResponse(_message.Message):
    __slots__ = ("request_id", "calibration")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    calibration: Calibration
    def __init__(self, request_id: _Optional[str] = ..., calibration: _Optional[_Union[Calibration, _Mapping]] = ...) -> None: ...

class CalibrateRequest(_message.Message):
    __slots__ = ("request_id", "hardware_type", "model_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    hardware_type: str
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., hardware_type: _Optional[str] = ..., model_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CalibrateResponse(_message.Message):
    __slots__ = ("request_id", "calibration")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    calibration: Calibration
    def __init__(self, request_id: _Optional[str] = ..., calibration: _Optional[_Union[Calibration, _Mapping]] = ...) -> None: ...
