"""``python -m scheduler_svc``: serve InferenceService on ``ISERVE_SCHEDULER_ADDR``."""

from scheduler_svc.servicer import InferenceServicer
from services.service_main import ServiceParts, serve_service


def build(settings, store) -> ServiceParts:
    servicer = InferenceServicer(store, settings.queue_capacity)
    return ServiceParts(
        bindings=[servicer.binding()],
        background=[servicer.refresh_forever],
        on_start=servicer.router.refresh,
        on_stop=servicer.close,
        drain=servicer.in_flight.drain,
        registry=servicer.registry,
    )


if __name__ == "__main__":
    serve_service("scheduler", build)
