"""``python -m gateway_svc`` (``iserve gateway``): the OpenAI-compatible HTTP gateway.

Listens on ``ISERVE_GATEWAY_ADDR`` (default 127.0.0.1:8000; ``ISERVE_CORS_ORIGINS`` lets
web pages of those origins call it) and talks to the scheduler,
deployment and model services at their configured addresses (``services.settings``).
"""

from __future__ import annotations

import logging
import os
import socket
import sys

import uvicorn

from gateway_svc.app import Backend, create_app
from gateway_svc.protocol import MAX_REQUEST_HEAD_BYTES, DeadlineH11Protocol
from services import transport
from services.grpc_server import configure_logging
from services.service_main import command_line, fail
from services.settings import (
    check_tls_identity,
    load_settings,
    tls_warnings,
    unknown_variables,
)


def main(args: list[str] | None = None) -> int:
    """Run the gateway; ``args`` are the command line's (None: ``sys.argv``'s), of which
    it takes none (``iserve gateway`` passes [])."""
    command_line("python -m gateway_svc", __doc__, args)
    try:
        # A client of the services (its own HTTP is plain): its certificate, if it
        # presents one, is a client's.
        settings = check_tls_identity(load_settings(), serving=False)
    except ValueError as exc:
        fail(str(exc))
    configure_logging(settings.log_level, "gateway")
    for warning in [*unknown_variables(), *tls_warnings(settings)]:
        logging.getLogger("iserve.gateway").warning("%s", warning)
    # The gateway is one of iserve's processes: model records are read with the service
    # token; each client's own token goes with its generations (Backend.connect).
    transport.configure(transport.Transport.for_service(settings))
    if not settings.auth:
        logging.getLogger("iserve.gateway").warning(
            "AUTHENTICATION IS OFF: anything that reaches %s may generate (set ISERVE_AUTH=on)",
            settings.gateway_address,
        )
    host, _, port = settings.gateway_address.rpartition(":")
    host = host.strip("[]")  # uvicorn takes an IPv6 address bare

    # The services it calls: where one is "host:0", the port `iserve up` chose for it.
    services = settings.as_recorded()

    def connect() -> Backend:
        return Backend.connect(
            services.address("scheduler"),
            services.address("deploy"),
            services.address("model"),
            settings.models_root,
            auth=settings.auth,
            drain_timeout_s=settings.drain_timeout_s,
        )

    # Bound here, before uvicorn starts: it logged "Application startup complete" and
    # then exited 3 on a port in use, the address's variable unnamed.
    try:
        listener = socket.create_server(
            (host or "127.0.0.1", int(port)),
            family=socket.AF_INET6 if ":" in host else socket.AF_INET,
        )
    except OSError as exc:
        fail(
            f"cannot bind {settings.gateway_address}: "
            f"{os.strerror(exc.errno) if exc.errno else exc} (set "
            "ISERVE_GATEWAY_ADDR to a free host:port)"
        )
    logging.getLogger("iserve.gateway").info(
        "OpenAI-compatible gateway on http://%s/v1", settings.gateway_address
    )
    # Streams in flight at a stop finish within the drain timeout, as the scheduler's do;
    # the grace ends a second before uvicorn's own graceful-shutdown timeout.
    stream_grace_s = max(0.0, settings.drain_timeout_s - 1.0)
    config = uvicorn.Config(
        create_app(connect, settings.cors_origins, stream_grace_s, settings.tls),
        log_level=settings.log_level.lower(),
        # uvicorn's own records go through configure_logging's handler, in its format
        # (its default config wrote them without a time: "INFO: Started server process").
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        # A request must arrive whole within a deadline (slow or stalled clients held
        # their connections for ever).
        http=DeadlineH11Protocol,
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
    )
    uvicorn.Server(config).run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
