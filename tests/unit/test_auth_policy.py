"""The access policy lists every RPC iserve serves, and nothing else; tokens, the
ownership rules and the bearer header parse as documented."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

import services.api as api
from deploy_svc.tokens import TokenServicer
from services.api import deployment_service_pb2 as deploy_pb
from services.api import token_service_pb2 as token_pb
from services.auth import access, policy
from services.auth.tokens import (
    Principal,
    ServiceTokenAuthenticator,
    StoreAuthenticator,
    bearer,
    check_grants,
    check_token_id,
    digest,
    issue,
    new_token,
    token_id_of,
)
from services.errors import InvalidArgument, NotFound, PermissionDenied


def _served_methods() -> set[str]:
    files = [getattr(api, name).DESCRIPTOR for name in api.__all__ if name.endswith("_pb2")]
    files += [health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR]
    methods = set()
    for file in files:
        for service in file.services_by_name.values():
            for method in service.methods:
                methods.add(f"/{service.full_name}/{method.name}")
    return methods


def test_every_served_rpc_is_in_the_policy_and_nothing_else():
    served = _served_methods()
    assert served - set(policy.POLICY) == set(), "RPCs missing from services.auth.policy"
    assert set(policy.POLICY) - served == set(), "policy names RPCs nobody serves"


def test_unlisted_methods_are_refused_and_only_health_is_open():
    assert policy.roles_for("/iserve.v1.ModelService/Nope") is None
    open_methods = {m for m, roles in policy.POLICY.items() if not roles}
    assert open_methods == {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"}
    # Workers know only the service token; tokens are the administrators'.
    for method, roles in policy.POLICY.items():
        if method.startswith("/iserve.v1.WorkerService/"):
            assert roles == {policy.SERVICE}
        if method.startswith("/iserve.v1.TokenService/"):
            assert roles == {policy.ADMIN}


class _Records:
    def __init__(self):
        self.rows: dict[str, tuple[token_pb.TokenInfo, str]] = {}

    def add(self, token: str, role: int, subject: str, grants=()) -> None:
        info = token_pb.TokenInfo(
            token_id=token_id_of(token), subject=subject, role=role, deployments=grants
        )
        self.rows[info.token_id] = (info, digest(token))

    async def get_token(self, token_id):
        return self.rows.get(token_id)


def test_issued_tokens_resolve_and_altered_ones_do_not():
    records = _Records()
    token_id, token = new_token()
    assert token.startswith(f"isv_{token_id}_") and token_id_of(token) == token_id
    records.add(token, policy.APP_USER, "alice", ("dep-1",))
    auth = StoreAuthenticator(records)
    found = asyncio.run(auth.authenticate(token))
    assert found == Principal(token_id, "alice", policy.APP_USER, ("dep-1",))
    altered = token[:-1] + ("A" if token[-1] != "A" else "B")  # same id, other secret
    assert token_id_of(altered) == token_id
    for bad in (altered, "", "isv_" + "0" * 16 + "_" + "x" * 40, token + "x" * 600):
        assert asyncio.run(auth.authenticate(bad)) is None


def test_supplied_tokens_get_an_id_from_their_hash():
    supplied = "operator-chosen-secret-0123456789"
    assert token_id_of(supplied) == "s" + digest(supplied)[:15]
    service = ServiceTokenAuthenticator(supplied)
    assert asyncio.run(service.authenticate(supplied)).role == policy.SERVICE
    assert asyncio.run(service.authenticate(supplied + "x")) is None


@pytest.mark.parametrize(
    "value,token",
    [
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("Basic abc", ""),
        ("", ""),
        ([("authorization", "Bearer t1"), ("x", "y")], "t1"),
        ([("authorization", b"Bearer t2")], "t2"),
        ([("x-other", "Bearer t3")], ""),
    ],
)
def test_bearer_reads_the_authorization_entry(value, token):
    assert bearer(value) == token


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=700))
def test_any_presented_text_is_refused_without_raising(text):
    records = _Records()
    records.add("a-real-token-of-enough-length-000", policy.ADMIN, "admin")
    assert bearer(text) == "" or isinstance(bearer(text), str)
    assert asyncio.run(StoreAuthenticator(records).authenticate(text)) is None


def _as(principal: Principal):
    token = access.set_caller(principal)
    return token


def _dep(deployment_id: str, owner: str) -> deploy_pb.Deployment:
    return deploy_pb.Deployment(deployment_id=deployment_id, owner=owner)


def test_ownership_rules_by_role():
    alice = Principal("t1", "alice", policy.APP_DEVELOPER)
    bob = Principal("t2", "bob", policy.MODEL_DEVELOPER)
    user = Principal("t3", "app", policy.APP_USER, ("d1",))
    everyone = Principal("t4", "ops", policy.APP_USER, ("*",))
    admin = Principal("t5", "root", policy.ADMIN)
    deployments = [_dep("d1", "alice"), _dep("d2", "carol")]

    token = _as(alice)
    try:
        access.check_owner("deployment d1", "alice")
        with pytest.raises(PermissionDenied, match="owned by carol"):
            access.check_owner("deployment d2", "carol")
        assert access.may_use("d1", "alice") and not access.may_use("d2", "carol")
        assert access.visible(deployments) == deployments  # developers see the cluster
    finally:
        access.reset_caller(token)

    token = _as(bob)
    try:
        with pytest.raises(PermissionDenied):
            access.check_owner("model m", "")  # no owner: only administrators
        assert not access.may_use("d1", "alice")
    finally:
        access.reset_caller(token)

    token = _as(alice)
    try:
        with pytest.raises(PermissionDenied, match="may not use deployment d2"):
            access.check_use("d2", "carol", unknown=NotFound("deployment d2 not found"))
        # ... but reads it, as its listing shows it (GetDeployment refused what
        # ListDeployments returned).
        access.check_see("d2", "carol", unknown=NotFound("deployment d2 not found"))
    finally:
        access.reset_caller(token)

    token = _as(user)
    try:
        assert access.may_use("d1", "alice") and not access.may_use("d2", "carol")
        assert [d.deployment_id for d in access.visible(deployments)] == ["d1"]
        access.check_use("d1", "alice", unknown=NotFound("deployment d1 not found"))
        # A user learns nothing of deployments its token does not grant: one it may not
        # use is refused as one that does not exist.
        with pytest.raises(NotFound, match="^deployment d2 not found$"):
            access.check_use("d2", "carol", unknown=NotFound("deployment d2 not found"))
        with pytest.raises(NotFound, match="^deployment d2 not found$"):
            access.check_see("d2", "carol", unknown=NotFound("deployment d2 not found"))
        access.check_see("d1", "alice", unknown=NotFound("deployment d1 not found"))
    finally:
        access.reset_caller(token)

    for who in (everyone, admin):
        token = _as(who)
        try:
            assert access.may_use("d2", "carol")
            assert access.visible(deployments) == deployments
        finally:
            access.reset_caller(token)

    # Authentication off: an anonymous administrator owning nothing.
    assert access.caller() is access.ANONYMOUS and access.owner() == ""
    access.check_owner("anything", "someone")


def test_the_security_page_lists_the_policy_as_it_is():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    documented = {}
    for line in page.splitlines():
        if line.startswith("| `/"):
            method, roles = (cell.strip() for cell in line.strip("|").split("|"))
            documented[method.strip("`")] = roles
    expected = {
        method: "anyone (no token)"
        if not roles
        else ", ".join(sorted(policy.role_name(r) for r in roles))
        for method, roles in policy.POLICY.items()
    }
    assert documented == expected


def test_a_valid_token_is_remembered_for_its_cache_time_and_no_longer():
    records = _Records()
    token = "an-operator-token-of-enough-length"
    records.add(token, policy.ADMIN, "ops")
    now = [100.0]
    auth = StoreAuthenticator(records, cache_s=1.0, clock=lambda: now[0])
    assert asyncio.run(auth.authenticate(token)).subject == "ops"
    records.rows.clear()  # revoked
    now[0] += 0.5
    assert asyncio.run(auth.authenticate(token)).subject == "ops"  # still remembered
    now[0] += 0.6
    assert asyncio.run(auth.authenticate(token)) is None  # read again: gone
    assert asyncio.run(auth.authenticate(token)) is None  # refusals are never remembered


@pytest.mark.parametrize(
    "role,grants,message",
    [
        (policy.APP_USER, [], "must grant deployments"),
        (policy.APP_DEVELOPER, ["d1"], "only app-user tokens grant"),
        (policy.APP_USER, ["bad:id"], "invalid deployment_id"),
        (policy.APP_USER, [f"d{i}" for i in range(257)], "at most 256"),
    ],
)
def test_bad_grants_are_refused(role, grants, message):
    with pytest.raises(InvalidArgument, match=message):
        check_grants(role, grants)


def test_grants_are_kept_once_and_token_ids_follow_the_issued_shape():
    assert check_grants(policy.APP_USER, ["d1", "d1", "*"]) == ["d1", "*"]
    token_id, token = new_token()
    assert check_token_id(token_id) == token_id
    assert check_token_id(token_id_of("an-operator-token-of-enough-length")).startswith("s")
    for bad in ("", "x:y", token_id + "\n", "0" * 17, "g" * 16):
        with pytest.raises(InvalidArgument, match="invalid token id"):
            check_token_id(bad)
    # The token itself, given where its id goes (a revoke of a leaked token): the error,
    # which the service logs, names its id and never the secret.
    with pytest.raises(InvalidArgument) as given:
        check_token_id(token)
    assert str(given.value) == (
        f"that is a token itself, not its id: its id is {token_id} (the secret was not kept)"
    )
    with pytest.raises(InvalidArgument) as given:
        check_token_id("an-operator-token-of-enough-length")
    assert "enough" not in str(given.value) and "34-character value, not shown" in str(given.value)


def test_issuing_checks_the_request_and_records_only_the_hash():
    class Records(_Records):
        async def put_token(self, info, sha256):
            self.rows[info.token_id] = (info, sha256)
            return True

    records = Records()
    with pytest.raises(InvalidArgument, match="invalid subject"):
        asyncio.run(issue(records, "alice\n", policy.ADMIN, []))
    with pytest.raises(InvalidArgument, match="invalid role"):
        asyncio.run(issue(records, "alice", 99, []))
    # A refused subject comes back cut to a readable length, not a megabyte of details.
    with pytest.raises(InvalidArgument, match=r"invalid subject 'aaa.*\(10000 characters\)") as cut:
        asyncio.run(issue(records, "a" * 10_000, policy.APP_DEVELOPER, []))
    assert len(str(cut.value)) < 200
    # The supplied tokens' subjects: records are owned by subject.
    for reserved in ("admin", "iserve", "Admin", "ISERVE"):
        with pytest.raises(
            InvalidArgument, match=f"subject '{reserved}' is reserved for the stack's own"
        ):
            asyncio.run(issue(records, reserved, policy.MODEL_DEVELOPER, []))
    assert records.rows == {}  # nothing recorded for a refused request
    info, token = asyncio.run(issue(records, "alice", policy.APP_USER, ["d1"]))
    stored, hashed = records.rows[info.token_id]
    assert stored == info and hashed == digest(token) and token not in str(stored)


def test_token_rpcs_refuse_a_bad_request_id_before_touching_the_store():
    """Through a real server: its DecodeInterceptor refuses the id (the one check of it
    for every RPC), shortened in the message, and the servicer never runs."""
    import grpc

    from services.api import token_service_pb2_grpc
    from services.grpc_server import channel, start_server

    class Untouched:
        def __getattr__(self, name):
            raise AssertionError(f"the store was asked for {name}")

    request_id = "r" * 100_000

    async def main():
        server, port, _ = await start_server([TokenServicer(Untouched()).binding()], "127.0.0.1:0")
        try:
            async with channel(f"127.0.0.1:{port}") as chan:
                stub = token_service_pb2_grpc.TokenServiceStub(chan)
                calls = [
                    lambda: stub.CreateToken(
                        token_pb.CreateTokenRequest(
                            request_id=request_id,
                            subject="alice",
                            role=policy.APP_USER,
                            deployments=["d1"],
                        )
                    ),
                    lambda: stub.ListTokens(token_pb.ListTokensRequest(request_id=request_id)),
                    lambda: stub.RevokeToken(
                        token_pb.RevokeTokenRequest(request_id=request_id, token_id="0" * 16)
                    ),
                ]
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call()
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "invalid request_id 'rrr" in err.value.details()
                    assert "(100000 characters)" in err.value.details()
                    assert len(err.value.details()) < 200
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_stack_that_checks_no_token_issues_none():
    """With authentication off, anyone could call CreateToken with no token and keep the
    admin token it issued: valid once the stack was started with ISERVE_AUTH=on."""
    from services.errors import FailedPrecondition
    from services.settings import load_settings

    class Records(_Records):
        async def put_token(self, info, sha256):
            self.rows[info.token_id] = (info, sha256)
            return True

    open_stack = load_settings({"ISERVE_STATE_DIR": "/nonexistent"})
    request = token_pb.CreateTokenRequest(request_id="r1", subject="mallory", role=policy.ADMIN)
    records = Records()
    with pytest.raises(FailedPrecondition, match="does not check tokens .* issues none"):
        asyncio.run(TokenServicer(records, open_stack).CreateToken(request, None))
    assert records.rows == {}
    checked = dataclasses.replace(open_stack, auth=True)
    reply = asyncio.run(TokenServicer(records, checked).CreateToken(request, None))
    assert reply.secret and list(records.rows) == [reply.token.token_id]
