"""TokenService: issue, list and revoke bearer tokens (administrators only, by policy)."""

from __future__ import annotations

from services.api import token_service_pb2 as token_pb
from services.api import token_service_pb2_grpc
from services.auth.tokens import check_token_id, issue, token_id_of
from services.errors import FailedPrecondition, NotFound
from services.grpc_server import ServiceBinding
from services.ids import check_request_id
from services.settings import ADMIN_TOKEN_ENV, SERVICE_TOKEN_ENV, Settings
from services.state.store import StateStore


class TokenServicer(token_service_pb2_grpc.TokenServiceServicer):
    def __init__(self, store: StateStore, settings: Settings | None = None):
        self.store = store
        # The tokens this stack runs on, by id: revoking one would lock every service
        # (the service token) or the operator (the admin token) out until a restart
        # registered it again. They are rotated by their settings (docs/security.md).
        self.in_use: dict[str, str] = {}
        if settings is not None and settings.auth:
            for setting, token in (
                (SERVICE_TOKEN_ENV, settings.service_token),
                (ADMIN_TOKEN_ENV, settings.admin_token),
            ):
                if token:
                    self.in_use[token_id_of(token)] = setting

    def binding(self) -> ServiceBinding:
        return ServiceBinding(
            self,
            token_service_pb2_grpc.add_TokenServiceServicer_to_server,
            "iserve.v1.TokenService",
        )

    async def CreateToken(self, request, context):
        check_request_id(request.request_id)
        info, secret = await issue(self.store, request.subject, request.role, request.deployments)
        return token_pb.CreateTokenResponse(
            request_id=request.request_id, token=info, secret=secret
        )

    async def ListTokens(self, request, context):
        check_request_id(request.request_id)
        tokens = await self.store.list_tokens()
        return token_pb.ListTokensResponse(request_id=request.request_id, tokens=tokens)

    async def RevokeToken(self, request, context):
        check_request_id(request.request_id)
        token_id = check_token_id(request.token_id)
        setting = self.in_use.get(token_id)
        if setting is not None:
            raise FailedPrecondition(
                f"token {token_id} is this stack's {setting}, which the services use: to "
                f"rotate it, set a new {setting}, restart the services, then revoke the "
                "old id"
            )
        if not await self.store.delete_token(token_id):
            raise NotFound(f"token {token_id} not found")
        return token_pb.RevokeTokenResponse(request_id=request.request_id)
