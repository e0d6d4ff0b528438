"""``python -m fingerprint_svc``: serve ModelService on ``ISERVE_MODEL_ADDR``."""

from fingerprint_svc.servicer import ModelServicer
from services.api import model_service_pb2_grpc
from services.grpc_server import ServiceBinding
from services.service_main import ServiceParts, serve_service


def build(settings, store) -> ServiceParts:
    return ServiceParts(
        bindings=[
            ServiceBinding(
                ModelServicer(settings, store),
                model_service_pb2_grpc.add_ModelServiceServicer_to_server,
                "iserve.v1.ModelService",
            )
        ]
    )


if __name__ == "__main__":
    serve_service("model", build)
