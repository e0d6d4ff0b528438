"""TokenService: issue, list and revoke bearer tokens (administrators only, by policy)."""

from __future__ import annotations

from services.api import token_service_pb2 as token_pb
from services.api import token_service_pb2_grpc
from services.auth import policy
from services.auth.tokens import check_role, check_subject, digest, new_token
from services.errors import InvalidArgument, NotFound
from services.grpc_server import ServiceBinding
from services.ids import check_deployment_id
from services.state.store import StateStore, now_ms

MAX_GRANTS = 256


class TokenServicer(token_service_pb2_grpc.TokenServiceServicer):
    def __init__(self, store: StateStore):
        self.store = store

    def binding(self) -> ServiceBinding:
        return ServiceBinding(
            self,
            token_service_pb2_grpc.add_TokenServiceServicer_to_server,
            "iserve.v1.TokenService",
        )

    async def CreateToken(self, request, context):
        subject = check_subject(request.subject)
        role = check_role(request.role)
        grants = list(dict.fromkeys(request.deployments))
        if len(grants) > MAX_GRANTS:
            raise InvalidArgument(f"a token grants at most {MAX_GRANTS} deployments")
        for grant in grants:
            if grant != "*":
                check_deployment_id(grant)
        if grants and role != policy.APP_USER:
            raise InvalidArgument(
                "only app-user tokens grant deployments (developers use what they own)"
            )
        if role == policy.APP_USER and not grants:
            raise InvalidArgument("an app-user token must grant deployments (ids, or '*')")
        while True:
            token_id, secret = new_token()
            info = token_pb.TokenInfo(
                token_id=token_id,
                subject=subject,
                role=role,
                deployments=grants,
                created_at_unix_ms=now_ms(),
            )
            if await self.store.put_token(info, digest(secret)):
                break
        return token_pb.CreateTokenResponse(
            request_id=request.request_id, token=info, secret=secret
        )

    async def ListTokens(self, request, context):
        tokens = await self.store.list_tokens()
        return token_pb.ListTokensResponse(request_id=request.request_id, tokens=tokens)

    async def RevokeToken(self, request, context):
        if not request.token_id or ":" in request.token_id or len(request.token_id) > 64:
            raise InvalidArgument(f"invalid token id {request.token_id!r}")
        if not await self.store.delete_token(request.token_id):
            raise NotFound(f"token {request.token_id} not found")
        return token_pb.RevokeTokenResponse(request_id=request.request_id)
