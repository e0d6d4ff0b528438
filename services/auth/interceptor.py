"""The server interceptor that enforces :mod:`services.auth.policy` on every call.

Each call's ``authorization: Bearer <token>`` metadata is resolved to a
:class:`~services.auth.tokens.Principal` by the process's authenticator and checked
against the method's roles before the servicer runs; the servicer then sees the caller
through :func:`services.auth.access.caller`. Refusals: UNAUTHENTICATED without a valid
token, PERMISSION_DENIED when the role may not call the method or the method is not in
the policy. When the token registry cannot be read (Redis down) the call is UNAVAILABLE.
Every refusal is logged (:class:`~services.auth.refusals.RefusalLog`: the method, the
client's host and the reason, at most once per 10 s per method, host and reason).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable

import grpc

from services.auth import access, policy
from services.auth.refusals import RefusalLog, client_host
from services.auth.tokens import Authenticator, Principal, authorization_entries, bearer
from services.errors import IServeError

log = logging.getLogger("iserve.auth")


_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, authenticator: Authenticator):
        self.authenticator = authenticator
        self.refusals = RefusalLog(log)
        # Each method's guarded handler, built on its first call (a server's handlers do
        # not change while it runs).
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        guarded = self._guarded.get(method)
        if guarded is not None:
            return guarded
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        self._guarded[method] = guarded = self._guard(method, handler)
        return guarded

    def _guard(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        roles = policy.roles_for(method)
        if roles is not None and not roles:
            return handler  # open: the health probes
        check = self._checker(method, roles)
        for attribute, make in _KINDS:
            behavior = getattr(handler, attribute)
            if behavior is not None:
                return make(
                    _guarded(behavior, check),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _checker(self, method: str, roles: frozenset[int] | None):
        async def refuse(context, code: grpc.StatusCode, reason: str, message: str):
            self.refusals.refused(client_host(context.peer()), reason, method)
            await context.abort(code, message)

        async def check(context: grpc.aio.ServicerContext) -> Principal:
            if roles is None:
                await refuse(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    "not in the access policy",
                    f"{method} is not in iserve's access policy",
                )
            if authorization_entries(context.invocation_metadata()) > 1:
                await refuse(
                    context,
                    grpc.StatusCode.UNAUTHENTICATED,
                    "more than one authorization entry",
                    f"{method}: the call carries more than one `authorization` entry; send "
                    "one `authorization: Bearer <token>`",
                )
            token = bearer(context.invocation_metadata())
            if not token:
                await refuse(
                    context,
                    grpc.StatusCode.UNAUTHENTICATED,
                    "no bearer token",
                    f"{method} needs a bearer token (gRPC metadata `authorization: Bearer "
                    "<token>`; the CLI sends ISERVE_TOKEN)",
                )
            try:
                principal = await self.authenticator.authenticate(token)
            except Exception as exc:  # noqa: BLE001 - the registry is unreachable
                # The log has the whole error; the caller, who has not been authenticated,
                # its kind only (the store's message named Redis's address: a probe).
                log.warning("token check failed for %s: %s", method, exc)
                code = exc.code if isinstance(exc, IServeError) else grpc.StatusCode.UNAVAILABLE
                await context.abort(
                    code,
                    f"cannot check the token: token registry unreachable ({type(exc).__name__})",
                )
            if principal is None:
                unknown = self.authenticator.unknown
                await refuse(context, grpc.StatusCode.UNAUTHENTICATED, unknown, unknown)
            if principal.role not in roles:
                allowed = ", ".join(sorted(policy.role_name(r) for r in roles))
                await refuse(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{principal.describe()} may not call it",
                    f"{method} is for {allowed}; {principal.describe()} may not call it",
                )
            return principal

        return check


def _guarded(behavior: Callable, check: Callable):
    """``behavior`` run only after ``check`` admits the caller, who is then the call's
    :func:`~services.auth.access.caller`."""
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request, context):
            principal = await check(context)
            token = access.set_caller(principal)
            try:
                async for item in behavior(request, context):
                    yield item
            except IServeError as exc:
                exc.caller_role = principal.role  # what the error interceptor may tell it
                raise
            finally:
                # A stream closed from another context (its client went away) cannot
                # reset; the call's task ends with it anyway.
                with contextlib.suppress(ValueError):
                    access.reset_caller(token)

        return guarded_stream

    async def guarded(request, context):
        principal = await check(context)
        token = access.set_caller(principal)
        try:
            return await behavior(request, context)
        except IServeError as exc:
            exc.caller_role = principal.role  # what the error interceptor may tell it
            raise
        finally:
            access.reset_caller(token)

    return guarded
