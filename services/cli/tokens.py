"""``iserve token create|list|revoke``: the bearer tokens of an authenticated stack
(TokenService, on the deployment service's address; administrators only)."""

from __future__ import annotations

import json
import sys
import time
import uuid

import grpc
from google.protobuf import json_format

from services import transport
from services.api import deployment_service_pb2 as deploy_pb
from services.api import deployment_service_pb2_grpc, token_service_pb2_grpc
from services.api import token_service_pb2 as token_pb
from services.auth import policy
from services.auth.tokens import ISSUED_TOKEN, token_id_of
from services.cli import output
from services.settings import Settings


def _stub(settings: Settings) -> token_service_pb2_grpc.TokenServiceStub:
    return token_service_pb2_grpc.TokenServiceStub(
        transport.sync_channel(settings.address("deploy"))
    )


def _rid() -> str:
    return uuid.uuid4().hex[:16]


def _row(info: token_pb.TokenInfo) -> list:
    created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(info.created_at_unix_ms / 1000))
    return [
        info.token_id,
        info.subject,
        policy.role_name(info.role),
        ",".join(info.deployments) or "-",
        created,
    ]


def cmd_create(settings: Settings, args) -> int:
    # TokenService and DeploymentService both serve on the deployer's address.
    channel = transport.sync_channel(settings.address("deploy"))
    reply = token_service_pb2_grpc.TokenServiceStub(channel).CreateToken(
        token_pb.CreateTokenRequest(
            request_id=_rid(),
            subject=args.subject,
            role=policy.ROLES_BY_NAME[args.role],
            deployments=args.deployment or [],
        )
    )
    for grant in _unknown(channel, reply.token.deployments):
        # Made anyway (a grant is an id, checked for its form only), but such a token
        # could generate nowhere and said so only at its first request, as a 404.
        print(
            f"warning: no deployment {grant} exists (`iserve status` lists their ids; "
            "`iserve deploy` prints each new one): this token cannot generate on it",
            file=sys.stderr,
        )
    if args.json:
        record = json_format.MessageToDict(reply.token, preserving_proto_field_name=True)
        print(json.dumps({**record, "token": reply.secret}))
        return 0
    print(reply.secret)
    print(
        f"token {reply.token.token_id} for {reply.token.subject} "
        f"({policy.role_name(reply.token.role)}); shown once: iserve keeps only its hash",
        file=sys.stderr,
    )
    return 0


def _unknown(channel: grpc.Channel, grants) -> list[str]:
    """The deployment ids of ``grants`` that name no deployment of the stack (asked of
    the DeploymentService on ``channel``)."""
    named = [grant for grant in grants if grant != "*"]
    if not named:
        return []
    stub = deployment_service_pb2_grpc.DeploymentServiceStub(channel)
    listed = stub.ListDeployments(deploy_pb.ListDeploymentsRequest(request_id=_rid()))
    known = {d.deployment_id for d in listed.deployments}
    return [grant for grant in named if grant not in known]


def cmd_list(settings: Settings, args) -> int:
    reply = _stub(settings).ListTokens(token_pb.ListTokensRequest(request_id=_rid()))
    if args.json:
        for info in reply.tokens:
            print(json.dumps(json_format.MessageToDict(info, preserving_proto_field_name=True)))
        return 0
    rows = [_row(info) for info in reply.tokens]
    output.show_tables([(None, ["TOKEN", "SUBJECT", "ROLE", "DEPLOYMENTS", "CREATED"], rows)])
    return 0


def cmd_revoke(settings: Settings, args) -> int:
    token_id = args.token_id
    if ISSUED_TOKEN.fullmatch(token_id):
        # The token itself, pasted (a leaked one, say): its id is in it; the secret is
        # not sent anywhere.
        token_id = token_id_of(token_id)
    _stub(settings).RevokeToken(token_pb.RevokeTokenRequest(request_id=_rid(), token_id=token_id))
    print(f"revoked {token_id}")
    return 0


def add_commands(sub) -> None:
    tokens = sub.add_parser(
        "token", help="bearer tokens of an authenticated stack (administrators)"
    ).add_subparsers(dest="token_command", required=True, metavar="ACTION")
    p = tokens.add_parser(
        "create",
        help="issue a token and print it (once)",
        description="Issue a token for SUBJECT with ROLE and print it on stdout; iserve "
        "keeps only its hash. Models and deployments made with it are owned by SUBJECT.",
    )
    p.add_argument("subject", help="who holds it: a person, team or application")
    p.add_argument("--role", required=True, choices=sorted(policy.ROLES_BY_NAME))
    p.add_argument(
        "--deployment",
        action="append",
        metavar="ID",
        help="app-user tokens: a deployment it may generate on (repeat; '*' for all)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object, the token included")
    p.set_defaults(func=cmd_create)
    p = tokens.add_parser("list", help="tokens: id, subject, role, grants (never the secrets)")
    p.add_argument("--json", action="store_true", help="one JSON object a line")
    p.set_defaults(func=cmd_list)
    p = tokens.add_parser(
        "revoke", help="refuse a token (every process within a second: each caches a check for 1 s)"
    )
    p.add_argument(
        "token_id", help="the id `iserve token list` shows (or the token itself: its id is read)"
    )
    p.set_defaults(func=cmd_revoke)
