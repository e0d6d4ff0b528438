"""Generated protobuf and gRPC stubs for ``iserve.v1`` (see ``services/protogen.py``).

Import messages from here, e.g. ``from services.api import common_pb2``.
"""

from services.api.iserve.v1 import (
    agent_service_pb2,
    agent_service_pb2_grpc,
    common_pb2,
    deployment_service_pb2,
    deployment_service_pb2_grpc,
    estimator_service_pb2,
    estimator_service_pb2_grpc,
    inference_service_pb2,
    inference_service_pb2_grpc,
    model_service_pb2,
    model_service_pb2_grpc,
    token_service_pb2,
    token_service_pb2_grpc,
    worker_service_pb2,
    worker_service_pb2_grpc,
)

__all__ = [
    "agent_service_pb2",
    "agent_service_pb2_grpc",
    "common_pb2",
    "deployment_service_pb2",
    "deployment_service_pb2_grpc",
    "estimator_service_pb2",
    "estimator_service_pb2_grpc",
    "inference_service_pb2",
    "inference_service_pb2_grpc",
    "model_service_pb2",
    "model_service_pb2_grpc",
    "token_service_pb2",
    "token_service_pb2_grpc",
    "worker_service_pb2",
    "worker_service_pb2_grpc",
]
