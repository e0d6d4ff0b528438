"""TokenService: issue, list and revoke bearer tokens (administrators only, by policy)."""

from __future__ import annotations

from services.api import token_service_pb2 as token_pb
from services.api import token_service_pb2_grpc
from services.auth.tokens import (
    check_issuing,
    check_revocable,
    check_token_id,
    issue,
    tokens_in_use,
)
from services.errors import NotFound
from services.grpc_server import ServiceBinding
from services.settings import Settings
from services.state.store import StateStore


class TokenServicer(token_service_pb2_grpc.TokenServiceServicer):
    def __init__(self, store: StateStore, settings: Settings | None = None):
        self.store = store
        self.in_use = tokens_in_use(settings) if settings is not None else {}
        self.authentication_off = settings is not None and not settings.auth

    def binding(self) -> ServiceBinding:
        return ServiceBinding(
            self,
            token_service_pb2_grpc.add_TokenServiceServicer_to_server,
            "iserve.v1.TokenService",
        )

    async def CreateToken(self, request, context):
        check_issuing(self.authentication_off)
        info, secret = await issue(self.store, request.subject, request.role, request.deployments)
        return token_pb.CreateTokenResponse(
            request_id=request.request_id, token=info, secret=secret
        )

    async def ListTokens(self, request, context):
        tokens = await self.store.list_tokens()
        return token_pb.ListTokensResponse(request_id=request.request_id, tokens=tokens)

    async def RevokeToken(self, request, context):
        token_id = check_token_id(request.token_id)
        check_revocable(token_id, self.in_use)
        if not await self.store.delete_token(token_id):
            raise NotFound(f"token {token_id} not found")
        return token_pb.RevokeTokenResponse(request_id=request.request_id)
