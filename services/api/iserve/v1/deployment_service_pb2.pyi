from services.api.iserve.v1 import common_pb2 as _common_pb2
from services.api.iserve.v1 import estimator_service_pb2 as _estimator_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeploymentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEPLOYMENT_STATE_UNSPECIFIED: _ClassVar[DeploymentState]
    DEPLOYMENT_STATE_STARTING: _ClassVar[DeploymentState]
    DEPLOYMENT_STATE_READY: _ClassVar[DeploymentState]
    DEPLOYMENT_STATE_FAILED: _ClassVar[DeploymentState]
    DEPLOYMENT_STATE_REMOVING: _ClassVar[DeploymentState]
DEPLOYMENT_STATE_UNSPECIFIED: DeploymentState
DEPLOYMENT_STATE_STARTING: DeploymentState
DEPLOYMENT_STATE_READY: DeploymentState
DEPLOYMENT_STATE_FAILED: DeploymentState
DEPLOYMENT_STATE_REMOVING: DeploymentState

class Replica(_message.Message):
    __slots__ = ("index", "placement", "worker_address", "state", "state_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    placement: _common_pb2.Placement
    worker_address: str
    state: DeploymentState
    state_reason: str
    def __init__(self, index: _Optional[int] = ..., placement: _Optional[_Union[_common_pb2.Placement, _Mapping]] = ..., worker_address: _Optional[str] = ..., state: _Optional[_Union[DeploymentState, str]] = ..., state_reason: _Optional[str] = ...) -> None: ...

class Deployment(_message.Message):
    __slots__ = ("deployment_id", "model_id", "config", "placement", "state", "state_reason", "worker_address", "max_input_tokens", "max_output_tokens", "created_at_unix_ms", "request_id", "estimate", "objectives", "latency_model", "replicas", "owner")
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVES_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    deployment_id: str
    model_id: str
    config: _common_pb2.DeploymentConfig
    placement: _common_pb2.Placement
    state: DeploymentState
    state_reason: str
    worker_address: str
    max_input_tokens: int
    max_output_tokens: int
    created_at_unix_ms: int
    request_id: str
    estimate: _estimator_service_pb2.ConfigEstimate
    objectives: _common_pb2.ServiceObjectives
    latency_model: _common_pb2.LatencyModel
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    owner: str
    def __init__(self, deployment_id: _Optional[str] = ..., model_id: _Optional[str] = ..., config: _Optional[_Union[_common_pb2.DeploymentConfig, _Mapping]] = ..., placement: _Optional[_Union[_common_pb2.Placement, _Mapping]] = ..., state: _Optional[_Union[DeploymentState, str]] = ..., state_reason: _Optional[str] = ..., worker_address: _Optional[str] = ..., max_input_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., created_at_unix_ms: _Optional[int] = ..., request_id: _Optional[str] = ..., estimate: _Optional[_Union[_estimator_service_pb2.ConfigEstimate, _Mapping]] = ..., objectives: _Optional[_Union[_common_pb2.ServiceObjectives, _Mapping]] = ..., latency_model: _Optional[_Union[_common_pb2.LatencyModel, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., owner: _Optional[str] = ...) -> None: ...

class SkippedConfig(_message.Message):
    __slots__ = ("rank", "config", "reason")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    config: _common_pb2.DeploymentConfig
    reason: str
    def __init__(self, rank: _Optional[int] = ..., config: _Optional[_Union[_common_pb2.DeploymentConfig, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class DeploymentDecision(_message.Message):
    __slots__ = ("config", "placement", "winner_rank", "skipped", "estimate", "note", "replica_placements")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    WINNER_RANK_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    config: _common_pb2.DeploymentConfig
    placement: _common_pb2.Placement
    winner_rank: int
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedConfig]
    estimate: _estimator_service_pb2.ConfigEstimate
    note: str
    replica_placements: _containers.RepeatedCompositeFieldContainer[_common_pb2.Placement]
    def __init__(self, config: _Optional[_Union[_common_pb2.DeploymentConfig, _Mapping]] = ..., placement: _Optional[_Union[_common_pb2.Placement, _Mapping]] = ..., winner_rank: _Optional[int] = ..., skipped: _Optional[_Iterable[_Union[SkippedConfig, _Mapping]]] = ..., estimate: _Optional[_Union[_estimator_service_pb2.ConfigEstimate, _Mapping]] = ..., note: _Optional[str] = ..., replica_placements: _Optional[_Iterable[_Union[_common_pb2.Placement, _Mapping]]] = ...) -> None: ...

class DeployRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "max_input_tokens", "max_output_tokens", "intent", "batch_size", "placement_policy", "config", "ready_timeout_ms", "objectives", "replicas")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INTENT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_POLICY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    READY_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    max_input_tokens: int
    max_output_tokens: int
    intent: _common_pb2.Intent
    batch_size: int
    placement_policy: _common_pb2.PlacementPolicy
    config: _common_pb2.DeploymentConfig
    ready_timeout_ms: int
    objectives: _common_pb2.ServiceObjectives
    replicas: int
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., max_input_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., intent: _Optional[_Union[_common_pb2.Intent, _Mapping]] = ..., batch_size: _Optional[int] = ..., placement_policy: _Optional[_Union[_common_pb2.PlacementPolicy, str]] = ..., config: _Optional[_Union[_common_pb2.DeploymentConfig, _Mapping]] = ..., ready_timeout_ms: _Optional[int] = ..., objectives: _Optional[_Union[_common_pb2.ServiceObjectives, _Mapping]] = ..., replicas: _Optional[int] = ...) -> None: ...

class DeployResponse(_message.Message):
    __slots__ = ("request_id", "deployment", "decision")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deployment: Deployment
    decision: DeploymentDecision
    def __init__(self, request_id: _Optional[str] = ..., deployment: _Optional[_Union[Deployment, _Mapping]] = ..., decision: _Optional[_Union[DeploymentDecision, _Mapping]] = ...) -> None: ...

class PlanDeploymentRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "max_input_tokens", "max_output_tokens", "intent", "batch_size", "placement_policy", "config", "devices", "objectives", "replicas")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INTENT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_POLICY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    max_input_tokens: int
    max_output_tokens: int
    intent: _common_pb2.Intent
    batch_size: int
    placement_policy: _common_pb2.PlacementPolicy
    config: _common_pb2.DeploymentConfig
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.DeviceState]
    objectives: _common_pb2.ServiceObjectives
    replicas: int
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., max_input_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., intent: _Optional[_Union[_common_pb2.Intent, _Mapping]] = ..., batch_size: _Optional[int] = ..., placement_policy: _Optional[_Union[_common_pb2.PlacementPolicy, str]] = ..., config: _Optional[_Union[_common_pb2.DeploymentConfig, _Mapping]] = ..., devices: _Optional[_Iterable[_Union[_common_pb2.DeviceState, _Mapping]]] = ..., objectives: _Optional[_Union[_common_pb2.ServiceObjectives, _Mapping]] = ..., replicas: _Optional[int] = ...) -> None: ...

class PlanDeploymentResponse(_message.Message):
    __slots__ = ("request_id", "decision")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decision: DeploymentDecision
    def __init__(self, request_id: _Optional[str] = ..., decision: _Optional[_Union[DeploymentDecision, _Mapping]] = ...) -> None: ...

class GetDeploymentRequest(_message.Message):
    __slots__ = ("request_id", "deployment_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deployment_id: str
    def __init__(self, request_id: _Optional[str] = ..., deployment_id: _Optional[str] = ...) -> None: ...

class GetDeploymentResponse(_message.Message):
    __slots__ = ("request_id", "deployment")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deployment: Deployment
    def __init__(self, request_id: _Optional[str] = ..., deployment: _Optional[_Union[Deployment, _Mapping]] = ...) -> None: ...

class ListDeploymentsRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "usable_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    USABLE_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    usable_only: bool
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., usable_only: _Optional[bool] = ...) -> None: ...

class ListDeploymentsResponse(_message.Message):
    __slots__ = ("request_id", "deployments")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deployments: _containers.RepeatedCompositeFieldContainer[Deployment]
    def __init__(self, request_id: _Optional[str] = ..., deployments: _Optional[_Iterable[_Union[Deployment, _Mapping]]] = ...) -> None: ...

class RemoveDeploymentRequest(_message.Message):
    __slots__ = ("request_id", "deployment_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deployment_id: str
    def __init__(self, request_id: _Optional[str] = ..., deployment_id: _Optional[str] = ...) -> None: ...

class RemoveDeploymentResponse(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GetClusterStateRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GetClusterStateResponse(_message.Message):
    __slots__ = ("request_id", "nodes", "deployments")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeState]
    deployments: _containers.RepeatedCompositeFieldContainer[Deployment]
    def __init__(self, request_id: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[_common_pb2.NodeState, _Mapping]]] = ..., deployments: _Optional[_Iterable[_Union[Deployment, _Mapping]]] = ...) -> None: ...
