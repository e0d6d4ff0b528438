"""``python -m fingerprint_svc``: serve ModelService on ``ISERVE_MODEL_ADDR``."""

from fingerprint_svc.profile_plan import ProfilingSettings
from fingerprint_svc.profiler import Profiler
from fingerprint_svc.servicer import ModelServicer
from services.api import model_service_pb2_grpc
from services.grpc_server import ServiceBinding
from services.service_main import ServiceParts, fail, serve_service


def build(settings, store) -> ServiceParts:
    try:
        profiling = ProfilingSettings.from_env()
    except ValueError as exc:
        fail(str(exc))
    profiler = Profiler(settings, store, profiling)
    return ServiceParts(
        bindings=[
            ServiceBinding(
                ModelServicer(settings, store, profiler),
                model_service_pb2_grpc.add_ModelServiceServicer_to_server,
                "iserve.v1.ModelService",
            )
        ],
        background=[profiler.recover],
        on_stop=profiler.close,
    )


if __name__ == "__main__":
    serve_service("model", build)
