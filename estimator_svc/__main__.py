"""``python -m estimator_svc``: serve EstimatorService on ``ISERVE_ESTIMATOR_ADDR``."""

from estimator_svc.service import Estimator
from estimator_svc.servicer import EstimatorServicer
from services.api import estimator_service_pb2_grpc
from services.grpc_server import ServiceBinding
from services.service_main import ServiceParts, serve_service


def build(settings, store) -> ServiceParts:
    return ServiceParts(
        bindings=[
            ServiceBinding(
                EstimatorServicer(Estimator(store)),
                estimator_service_pb2_grpc.add_EstimatorServiceServicer_to_server,
                "iserve.v1.EstimatorService",
            )
        ]
    )


if __name__ == "__main__":
    serve_service("estimator", build)
