"""A process's security from its settings: TLS, its own token, and who may call it."""

from __future__ import annotations

import asyncio
import logging

from services import transport
from services.auth import policy
from services.auth.tokens import (
    ADMIN_SUBJECT,
    SERVICE_SUBJECT,
    ServiceTokenAuthenticator,
    StoreAuthenticator,
    bearer,
    digest,
    token_id_of,
    token_info,
)
from services.grpc_server import ServerSecurity
from services.metrics import Guard
from services.settings import Settings
from services.state.store import StateStore
from services.transport import Transport

log = logging.getLogger("iserve.auth")
METRICS_CHECK_TIMEOUT_S = 5.0


async def register_supplied(store: StateStore, token: str, role: int, subject: str) -> None:
    """Record an operator-supplied token (idempotent: a token already there is kept)."""
    await store.put_token(token_info(token_id_of(token), subject, role), digest(token))


async def server_security(settings: Settings, store: StateStore | None) -> ServerSecurity:
    """This process's :class:`ServerSecurity`; also makes its outgoing calls carry the
    service token. With authentication on, a process with ``store`` checks tokens in
    Redis and registers the supplied service and admin tokens there; a worker (no store)
    accepts only the service token. ValueError when authentication is on without a
    usable service token."""
    own = Transport.for_service(settings)
    transport.configure(own)
    if not settings.auth:
        return ServerSecurity(own, None)
    service_token = settings.require_service_token()
    if store is None:
        return ServerSecurity(own, ServiceTokenAuthenticator(service_token))
    await register_supplied(store, service_token, policy.SERVICE, SERVICE_SUBJECT)
    if settings.admin_token:
        await register_supplied(store, settings.admin_token, policy.ADMIN, ADMIN_SUBJECT)
    return ServerSecurity(own, StoreAuthenticator(store))


def metrics_guard(security: ServerSecurity, loop: asyncio.AbstractEventLoop) -> Guard | None:
    """With authentication on, a guard for the Prometheus endpoint that lets in bearer
    tokens of the roles in ``policy.METRICS_ROLES``; it runs in the exporter's threads
    and checks on ``loop``, the process's own."""
    authenticator = security.authenticator
    if authenticator is None:
        return None

    def allowed(header: str) -> bool:
        token = bearer(header)
        if not token:
            return False
        check = asyncio.run_coroutine_threadsafe(authenticator.authenticate(token), loop)
        try:
            principal = check.result(timeout=METRICS_CHECK_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - registry unreachable: refuse
            log.warning("metrics: cannot check a token", exc_info=True)
            return False
        return principal is not None and principal.role in policy.METRICS_ROLES

    return allowed
