from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightQuant(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_QUANT_UNSPECIFIED: _ClassVar[WeightQuant]
    WEIGHT_QUANT_NONE: _ClassVar[WeightQuant]
    WEIGHT_QUANT_INT8: _ClassVar[WeightQuant]
    WEIGHT_QUANT_INT4: _ClassVar[WeightQuant]
    WEIGHT_QUANT_GPTQ_INT4: _ClassVar[WeightQuant]
    WEIGHT_QUANT_AWQ_INT4: _ClassVar[WeightQuant]

class KvQuant(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_QUANT_UNSPECIFIED: _ClassVar[KvQuant]
    KV_QUANT_NONE: _ClassVar[KvQuant]
    KV_QUANT_INT8: _ClassVar[KvQuant]

class Pruning(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRUNING_UNSPECIFIED: _ClassVar[Pruning]
    PRUNING_NONE: _ClassVar[Pruning]
    PRUNING_SEMI_STRUCTURED_2_4: _ClassVar[Pruning]
    PRUNING_STRUCTURED: _ClassVar[Pruning]

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_UNSPECIFIED: _ClassVar[Precision]
    PRECISION_FLOAT32: _ClassVar[Precision]
    PRECISION_FLOAT16: _ClassVar[Precision]
    PRECISION_BFLOAT16: _ClassVar[Precision]

class ModelFamily(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_FAMILY_UNSPECIFIED: _ClassVar[ModelFamily]
    MODEL_FAMILY_LLAMA: _ClassVar[ModelFamily]
    MODEL_FAMILY_QWEN2: _ClassVar[ModelFamily]
    MODEL_FAMILY_FALCON: _ClassVar[ModelFamily]
    MODEL_FAMILY_GPTJ: _ClassVar[ModelFamily]
    MODEL_FAMILY_MISTRAL: _ClassVar[ModelFamily]

class IntentKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INTENT_KIND_UNSPECIFIED: _ClassVar[IntentKind]
    INTENT_KIND_MIN_COST: _ClassVar[IntentKind]
    INTENT_KIND_MIN_LATENCY: _ClassVar[IntentKind]
    INTENT_KIND_MIN_MEMORY: _ClassVar[IntentKind]
    INTENT_KIND_MIN_DEVICE_HOURS: _ClassVar[IntentKind]
    INTENT_KIND_LATENCY_SLO: _ClassVar[IntentKind]
    INTENT_KIND_COST_SLO: _ClassVar[IntentKind]
    INTENT_KIND_MAX_THROUGHPUT: _ClassVar[IntentKind]

class CostFormula(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COST_FORMULA_UNSPECIFIED: _ClassVar[CostFormula]
    COST_FORMULA_MEMORY_TIMES_LATENCY: _ClassVar[CostFormula]
    COST_FORMULA_MEMORY: _ClassVar[CostFormula]
    COST_FORMULA_DEVICE_HOURS: _ClassVar[CostFormula]

class PlacementPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_POLICY_UNSPECIFIED: _ClassVar[PlacementPolicy]
    PLACEMENT_POLICY_HYBRID: _ClassVar[PlacementPolicy]
    PLACEMENT_POLICY_PACKING: _ClassVar[PlacementPolicy]
    PLACEMENT_POLICY_LEAST_LOADED: _ClassVar[PlacementPolicy]

class DeviceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_KIND_UNSPECIFIED: _ClassVar[DeviceKind]
    DEVICE_KIND_CPU_VIRTUAL: _ClassVar[DeviceKind]
    DEVICE_KIND_CUDA: _ClassVar[DeviceKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class SchedulingPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULING_POLICY_UNSPECIFIED: _ClassVar[SchedulingPolicy]
    SCHEDULING_POLICY_FCFS: _ClassVar[SchedulingPolicy]
    SCHEDULING_POLICY_EDF: _ClassVar[SchedulingPolicy]
WEIGHT_QUANT_UNSPECIFIED: WeightQuant
WEIGHT_QUANT_NONE: WeightQuant
WEIGHT_QUANT_INT8: WeightQuant
WEIGHT_QUANT_INT4: WeightQuant
WEIGHT_QUANT_GPTQ_INT4: WeightQuant
WEIGHT_QUANT_AWQ_INT4: WeightQuant
KV_QUANT_UNSPECIFIED: KvQuant
KV_QUANT_NONE: KvQuant
KV_QUANT_INT8: KvQuant
PRUNING_UNSPECIFIED: Pruning
PRUNING_NONE: Pruning
PRUNING_SEMI_STRUCTURED_2_4: Pruning
PRUNING_STRUCTURED: Pruning
PRECISION_UNSPECIFIED: Precision
PRECISION_FLOAT32: Precision
PRECISION_FLOAT16: Precision
PRECISION_BFLOAT16: Precision
MODEL_FAMILY_UNSPECIFIED: ModelFamily
MODEL_FAMILY_LLAMA: ModelFamily
MODEL_FAMILY_QWEN2: ModelFamily
MODEL_FAMILY_FALCON: ModelFamily
MODEL_FAMILY_GPTJ: ModelFamily
MODEL_FAMILY_MISTRAL: ModelFamily
INTENT_KIND_UNSPECIFIED: IntentKind
INTENT_KIND_MIN_COST: IntentKind
INTENT_KIND_MIN_LATENCY: IntentKind
INTENT_KIND_MIN_MEMORY: IntentKind
INTENT_KIND_MIN_DEVICE_HOURS: IntentKind
INTENT_KIND_LATENCY_SLO: IntentKind
INTENT_KIND_COST_SLO: IntentKind
INTENT_KIND_MAX_THROUGHPUT: IntentKind
COST_FORMULA_UNSPECIFIED: CostFormula
COST_FORMULA_MEMORY_TIMES_LATENCY: CostFormula
COST_FORMULA_MEMORY: CostFormula
COST_FORMULA_DEVICE_HOURS: CostFormula
PLACEMENT_POLICY_UNSPECIFIED: PlacementPolicy
PLACEMENT_POLICY_HYBRID: PlacementPolicy
PLACEMENT_POLICY_PACKING: PlacementPolicy
PLACEMENT_POLICY_LEAST_LOADED: PlacementPolicy
DEVICE_KIND_UNSPECIFIED: DeviceKind
DEVICE_KIND_CPU_VIRTUAL: DeviceKind
DEVICE_KIND_CUDA: DeviceKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
SCHEDULING_POLICY_UNSPECIFIED: SchedulingPolicy
SCHEDULING_POLICY_FCFS: SchedulingPolicy
SCHEDULING_POLICY_EDF: SchedulingPolicy

class CompressionVariant(_message.Message):
    __slots__ = ("name", "weight_quant", "kv_quant", "pruning", "structured_prune_fraction", "accuracy_score", "checkpoint_path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_QUANT_FIELD_NUMBER: _ClassVar[int]
    KV_QUANT_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_PRUNE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_SCORE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight_quant: WeightQuant
    kv_quant: KvQuant
    pruning: Pruning
    structured_prune_fraction: float
    accuracy_score: float
    checkpoint_path: str
    def __init__(self, name: _Optional[str] = ..., weight_quant: _Optional[_Union[WeightQuant, str]] = ..., kv_quant: _Optional[_Union[KvQuant, str]] = ..., pruning: _Optional[_Union[Pruning, str]] = ..., structured_prune_fraction: _Optional[float] = ..., accuracy_score: _Optional[float] = ..., checkpoint_path: _Optional[str] = ...) -> None: ...

class DeploymentConfig(_message.Message):
    __slots__ = ("tensor_parallel", "pipeline_parallel", "variant_name", "weight_quant", "kv_quant", "pruning", "batch_size", "dtype")
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    VARIANT_NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_QUANT_FIELD_NUMBER: _ClassVar[int]
    KV_QUANT_FIELD_NUMBER: _ClassVar[int]
    PRUNING_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel: int
    pipeline_parallel: int
    variant_name: str
    weight_quant: WeightQuant
    kv_quant: KvQuant
    pruning: Pruning
    batch_size: int
    dtype: Precision
    def __init__(self, tensor_parallel: _Optional[int] = ..., pipeline_parallel: _Optional[int] = ..., variant_name: _Optional[str] = ..., weight_quant: _Optional[_Union[WeightQuant, str]] = ..., kv_quant: _Optional[_Union[KvQuant, str]] = ..., pruning: _Optional[_Union[Pruning, str]] = ..., batch_size: _Optional[int] = ..., dtype: _Optional[_Union[Precision, str]] = ...) -> None: ...

class DeviceRef(_message.Message):
    __slots__ = ("node_id", "device_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    device_id: str
    def __init__(self, node_id: _Optional[str] = ..., device_id: _Optional[str] = ...) -> None: ...

class StagePlacement(_message.Message):
    __slots__ = ("stage", "first_layer", "layer_count", "devices", "reserved_bytes")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    first_layer: int
    layer_count: int
    devices: _containers.RepeatedCompositeFieldContainer[DeviceRef]
    reserved_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stage: _Optional[int] = ..., first_layer: _Optional[int] = ..., layer_count: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[DeviceRef, _Mapping]]] = ..., reserved_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("stages",)
    STAGES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StagePlacement]
    def __init__(self, stages: _Optional[_Iterable[_Union[StagePlacement, _Mapping]]] = ...) -> None: ...

class DeviceState(_message.Message):
    __slots__ = ("ref", "kind", "name", "hardware_type", "total_bytes", "used_bytes", "reserved_bytes", "free_bytes", "load", "cpu_cores", "deployment_ids", "updated_at_unix_ms")
    REF_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_TYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ref: DeviceRef
    kind: DeviceKind
    name: str
    hardware_type: str
    total_bytes: int
    used_bytes: int
    reserved_bytes: int
    free_bytes: int
    load: float
    cpu_cores: _containers.RepeatedScalarFieldContainer[int]
    deployment_ids: _containers.RepeatedScalarFieldContainer[str]
    updated_at_unix_ms: int
    def __init__(self, ref: _Optional[_Union[DeviceRef, _Mapping]] = ..., kind: _Optional[_Union[DeviceKind, str]] = ..., name: _Optional[str] = ..., hardware_type: _Optional[str] = ..., total_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., load: _Optional[float] = ..., cpu_cores: _Optional[_Iterable[int]] = ..., deployment_ids: _Optional[_Iterable[str]] = ..., updated_at_unix_ms: _Optional[int] = ...) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("node_id", "agent_address", "devices", "alive", "heartbeat_at_unix_ms", "unreachable", "stopped_at_unix_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    STOPPED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    agent_address: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceState]
    alive: bool
    heartbeat_at_unix_ms: int
    unreachable: str
    stopped_at_unix_ms: int
    def __init__(self, node_id: _Optional[str] = ..., agent_address: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceState, _Mapping]]] = ..., alive: _Optional[bool] = ..., heartbeat_at_unix_ms: _Optional[int] = ..., unreachable: _Optional[str] = ..., stopped_at_unix_ms: _Optional[int] = ...) -> None: ...

class ServiceObjectives(_message.Message):
    __slots__ = ("scheduling", "ttft_slo_ms", "tpot_slo_ms", "default_deadline_ms")
    SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    scheduling: SchedulingPolicy
    ttft_slo_ms: int
    tpot_slo_ms: int
    default_deadline_ms: int
    def __init__(self, scheduling: _Optional[_Union[SchedulingPolicy, str]] = ..., ttft_slo_ms: _Optional[int] = ..., tpot_slo_ms: _Optional[int] = ..., default_deadline_ms: _Optional[int] = ...) -> None: ...

class LatencyModel(_message.Message):
    __slots__ = ("prefill_fixed_ms", "prefill_ms_per_token", "decode_step_ms", "decode_ms_per_extra_sequence")
    PREFILL_FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_PER_EXTRA_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    prefill_fixed_ms: float
    prefill_ms_per_token: float
    decode_step_ms: float
    decode_ms_per_extra_sequence: float
    def __init__(self, prefill_fixed_ms: _Optional[float] = ..., prefill_ms_per_token: _Optional[float] = ..., decode_step_ms: _Optional[float] = ..., decode_ms_per_extra_sequence: _Optional[float] = ...) -> None: ...

class Intent(_message.Message):
    __slots__ = ("kind", "cost_formula", "latency_slo_ms", "cost_budget", "min_accuracy", "allow_best_available_accuracy")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COST_FORMULA_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    COST_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MIN_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    ALLOW_BEST_AVAILABLE_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    kind: IntentKind
    cost_formula: CostFormula
    latency_slo_ms: float
    cost_budget: float
    min_accuracy: float
    allow_best_available_accuracy: bool
    def __init__(self, kind: _Optional[_Union[IntentKind, str]] = ..., cost_formula: _Optional[_Union[CostFormula, str]] = ..., latency_slo_ms: _Optional[float] = ..., cost_budget: _Optional[float] = ..., min_accuracy: _Optional[float] = ..., allow_best_available_accuracy: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "stop")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "ttft_ms", "tpot_ms", "total_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    ttft_ms: float
    tpot_ms: float
    total_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...
