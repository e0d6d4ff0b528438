"""Authentication on (ISERVE_AUTH=on), on a real stack: every RPC of every server walked
with every role, ownership between developers, users limited to what their token
grants, revocation, the CLI, the gateway and the metrics endpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import (
    deployment_service_pb2_grpc,
    inference_service_pb2_grpc,
    model_service_pb2_grpc,
    token_service_pb2_grpc,
    worker_service_pb2_grpc,
)
from services.api import inference_service_pb2 as infer_pb
from services.api import model_service_pb2 as model_pb
from services.api import token_service_pb2 as token_pb
from services.api import worker_service_pb2 as worker_pb
from services.auth import policy
from services.cli import stack as launcher
from services.models.checkpoint import create_checkpoint
from services.settings import Settings, token_file
from tests.integration.helpers import TINY, rid, run_cli, wait_for

MODEL = "auth-llama"


@dataclass
class AuthStack:
    settings: Settings
    env: dict[str, str]
    tokens: dict[str, str]  # role name -> token
    deployment_id: str = ""
    worker_address: str = ""

    def channel(self, service: str) -> grpc.Channel:
        return grpc.insecure_channel(self.settings.address(service))


def _md(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token else ()


@pytest.fixture(scope="module")
def auth_stack(tmp_path_factory) -> Iterator[AuthStack]:
    env = {
        "ISERVE_AUTH": "on",
        "ISERVE_DEVICES": "2",
        "ISERVE_DEVICE_MEMORY_GIB": "2",
        "ISERVE_READY_TIMEOUT_S": "90",
    }
    state_dir = tmp_path_factory.mktemp("iserve-auth")
    with launcher.temporary_stack(env, state_dir=state_dir) as settings:
        admin = token_file(settings.state_dir, "admin").read_text().strip()
        service = token_file(settings.state_dir, "service").read_text().strip()
        assert oct(token_file(settings.state_dir, "admin").stat().st_mode & 0o777) == "0o600"
        tokens = {"admin": admin, "service": service}
        with grpc.insecure_channel(settings.address("deploy")) as ch:
            stub = token_service_pb2_grpc.TokenServiceStub(ch)
            for role, subject, grants in (
                (policy.MODEL_DEVELOPER, "mia", ()),
                (policy.APP_DEVELOPER, "adam", ()),
                (policy.APP_USER, "ursula", ("*",)),
            ):
                reply = stub.CreateToken(
                    token_pb.CreateTokenRequest(subject=subject, role=role, deployments=grants),
                    metadata=_md(admin),
                )
                tokens[policy.role_name(role)] = reply.secret
        env_now = {k: v for k, v in os.environ.items() if k.startswith("ISERVE_")}
        yield AuthStack(settings, env_now, tokens)


@pytest.fixture(scope="module")
def deployed(auth_stack) -> AuthStack:
    """The model registered by the model developer, deployed by the app developer."""
    s = auth_stack
    create_checkpoint(s.settings.models_root / MODEL, **TINY, overwrite=True)
    with s.channel("model") as ch:
        model_service_pb2_grpc.ModelServiceStub(ch).RegisterModel(
            model_pb.RegisterModelRequest(
                model_id=MODEL, checkpoint_path=MODEL, skip_profiling=True
            ),
            metadata=_md(s.tokens["model-developer"]),
        )
    with s.channel("deploy") as ch:
        reply = deployment_service_pb2_grpc.DeploymentServiceStub(ch).Deploy(
            deploy_pb.DeployRequest(
                request_id=rid(),
                model_id=MODEL,
                config=common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1),
            ),
            metadata=_md(s.tokens["app-developer"]),
            timeout=180,
        )
    assert reply.deployment.owner == "adam"
    s.deployment_id = reply.deployment.deployment_id
    s.worker_address = reply.deployment.worker_address
    return s


def _kind(method: str) -> str:
    service, name = method.strip("/").rsplit("/", 1)
    import services.api as api

    descriptors = [getattr(api, n).DESCRIPTOR for n in api.__all__ if n.endswith("_pb2")]
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    descriptors += [health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR]
    for file in descriptors:
        for svc in file.services_by_name.values():
            if svc.full_name == service:
                m = svc.methods_by_name[name]
                return (
                    ("stream" if m.client_streaming else "unary")
                    + "_"
                    + ("stream" if m.server_streaming else "unary")
                )
    raise KeyError(method)


def _call(address: str, method: str, token: str) -> grpc.StatusCode:
    """Call ``method`` with an empty request; the status it ends with."""
    ident = lambda b: b  # noqa: E731
    kind = _kind(method)
    with grpc.insecure_channel(address) as ch:
        factory = getattr(ch, kind)(method, request_serializer=ident, response_deserializer=ident)
        try:
            if kind == "unary_unary":
                factory(b"", metadata=_md(token), timeout=30)
            else:
                request = b"" if kind.startswith("unary") else iter(())
                call = factory(request, metadata=_md(token), timeout=30)
                for _ in call:
                    call.cancel()
                    break
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def _address_of(s: AuthStack, method: str) -> list[str]:
    service = method.strip("/").split("/")[0]
    by_service = {
        "iserve.v1.ModelService": ["model"],
        "iserve.v1.EstimatorService": ["estimator"],
        "iserve.v1.DeploymentService": ["deploy"],
        "iserve.v1.TokenService": ["deploy"],
        "iserve.v1.InferenceService": ["scheduler"],
        "iserve.v1.AgentService": ["agent"],
    }
    if service == "iserve.v1.WorkerService":
        return [s.worker_address]
    names = by_service.get(service, ["model", "scheduler", "agent"])
    addresses = [s.settings.address(n) for n in names]
    if service.startswith("grpc."):
        addresses.append(s.worker_address)  # workers answer health and reflection too
    return addresses


# Calls whose empty request would change the cluster if a role were let through that
# should be: they are walked with the denied roles only (allowed ones are shown by the
# flows below).
_MUTATING_WHEN_ALLOWED = {"/iserve.v1.AgentService/StopWorkers"}


def test_every_rpc_refuses_every_role_the_policy_does_not_list(deployed):
    s = deployed
    refused_wrongly, let_through = [], []
    roles = ["admin", "model-developer", "app-developer", "app-user", "service"]
    for method, allowed in sorted(policy.POLICY.items()):
        for address in _address_of(s, method):
            anonymous = _call(address, method, "")
            if allowed:
                if anonymous != grpc.StatusCode.UNAUTHENTICATED:
                    let_through.append((method, address, "no token", anonymous))
            elif anonymous in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                refused_wrongly.append((method, address, "no token", anonymous))
            for role in roles:
                may = not allowed or policy.ROLES_BY_NAME[role] in allowed
                if address == s.worker_address and allowed:
                    may = role == "service"  # the only token a worker knows
                if may and method in _MUTATING_WHEN_ALLOWED:
                    continue
                code = _call(address, method, s.tokens[role])
                denied = code in (
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.UNAUTHENTICATED,
                )
                if may and denied:
                    refused_wrongly.append((method, address, role, code))
                # A worker knows only the service token: other tokens are unknown to it.
                refused = (
                    denied
                    if address == s.worker_address
                    else code == grpc.StatusCode.PERMISSION_DENIED
                )
                if not may and not refused:
                    let_through.append((method, address, role, code))
    assert let_through == [], "roles the policy does not list got in:\n" + "\n".join(
        map(str, let_through)
    )
    assert refused_wrongly == [], "roles the policy lists were refused:\n" + "\n".join(
        map(str, refused_wrongly)
    )
    # A forged token of the right shape is refused everywhere it is checked.
    forged = "isv_" + "0" * 16 + "_" + "A" * 43
    assert (
        _call(s.settings.address("deploy"), "/iserve.v1.DeploymentService/ListDeployments", forged)
        == grpc.StatusCode.UNAUTHENTICATED
    )
    # A worker knows only the service token, and says so of any other.
    code, details = _refusal(
        lambda: worker_service_pb2_grpc.WorkerServiceStub(
            grpc.insecure_channel(s.worker_address)
        ).GetWorkerStats(worker_pb.GetWorkerStatsRequest(), metadata=_md(s.tokens["admin"]))
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert details.startswith("not the stack's service token: a worker answers only the services")
    # The walk changed nothing the deployment needs: it still serves.
    _generate(s, s.tokens["app-user"], deployment_id=s.deployment_id)


def _generate(s: AuthStack, token: str, **target) -> int:
    with s.channel("scheduler") as ch:
        stub = inference_service_pb2_grpc.InferenceServiceStub(ch)
        n = 0
        for reply in stub.Generate(
            infer_pb.GenerateRequest(request_id=rid(), prompt="hello", max_tokens=4, **target),
            metadata=_md(token),
            timeout=60,
        ):
            n += reply.HasField("delta")
        return n


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _refusal(fn, value: str = "") -> tuple[grpc.StatusCode, str]:
    """The status ``fn`` ends with and its details, ``value`` in them written ``<id>``."""
    try:
        fn()
    except grpc.RpcError as exc:
        details = exc.details() or ""
        return exc.code(), details.replace(value, "<id>") if value else details
    return grpc.StatusCode.OK, ""


def _new_token(s: AuthStack, subject: str, role: int) -> str:
    with s.channel("deploy") as ch:
        return (
            token_service_pb2_grpc.TokenServiceStub(ch)
            .CreateToken(
                token_pb.CreateTokenRequest(subject=subject, role=role),
                metadata=_md(s.tokens["admin"]),
            )
            .secret
        )


def _import_request(s: AuthStack, model: str) -> model_pb.ImportProfilesRequest:
    """One MaverIQ row for ``model``, shaped by the stack's tiny checkpoint."""
    rows = (
        "Model,TP,PP,PP_Map,DTYPE,INT8_KV_Cache,Output_Lenght,Batch_Size,Latency,"
        "Memory-Pre-Run,Memory-After-Run,Time-Gen-Graph,Time-Prof\n"
        f"{model},1,1,1,float16,False,10,1,0.05,1.0,1.1,10,5\n"
    )
    return model_pb.ImportProfilesRequest(
        format=model_pb.PROFILE_FORMAT_MAVERIQ,
        hardware_type="rtx-a6000",
        files=[
            model_pb.ProfileFile(name="fingerprint_data_collection_BS.csv", content=rows.encode())
        ],
        model_configs={model: (s.settings.models_root / MODEL / "config.json").read_text()},
    )


def test_model_developers_import_profiles_only_into_their_own_models(deployed):
    s = deployed
    ines = _new_token(s, "ines", policy.MODEL_DEVELOPER)
    admin = _md(s.tokens["admin"])
    with s.channel("model") as ch:
        models = model_service_pb2_grpc.ModelServiceStub(ch)
        before = models.GetModel(model_pb.GetModelRequest(model_id=MODEL), metadata=admin).model
        code, details = _refusal(
            lambda: models.ImportProfiles(_import_request(s, MODEL), metadata=_md(ines))
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert f"model {MODEL!r} is owned by mia" in details
        # Nothing written: the record as it was, and still no profile.
        after = models.GetModel(model_pb.GetModelRequest(model_id=MODEL), metadata=admin).model
        assert after == before
        no_profile = _code(
            lambda: models.GetProfile(model_pb.GetProfileRequest(model_id=MODEL), metadata=admin)
        )
        assert no_profile == grpc.StatusCode.FAILED_PRECONDITION

        # A model an import creates is the importer's: others may not import into it,
        # its owner may delete it.
        models.ImportProfiles(_import_request(s, "ines-import"), metadata=_md(ines))
        created = models.GetModel(
            model_pb.GetModelRequest(model_id="ines-import"), metadata=admin
        ).model
        assert created.owner == "ines"
        code, details = _refusal(
            lambda: models.ImportProfiles(
                _import_request(s, "ines-import"), metadata=_md(s.tokens["model-developer"])
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED and "owned by ines" in details
        models.DeleteModel(model_pb.DeleteModelRequest(model_id="ines-import"), metadata=_md(ines))


def test_refused_values_come_back_at_most_80_characters_long(deployed):
    """docs/security.md: a megabyte value must not come back as a megabyte of details
    (a 10 MB token subject made the client see RESOURCE_EXHAUSTED, not the refusal)."""
    s = deployed
    with s.channel("deploy") as ch:
        code, details = _refusal(
            lambda: token_service_pb2_grpc.TokenServiceStub(ch).CreateToken(
                token_pb.CreateTokenRequest(subject="a" * 10_000_000, role=policy.APP_DEVELOPER),
                metadata=_md(s.tokens["admin"]),
                timeout=60,
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "invalid subject" in details
        assert len(details) < 300, len(details)
        code, details = _refusal(
            lambda: deployment_service_pb2_grpc.DeploymentServiceStub(ch).PlanDeployment(
                deploy_pb.PlanDeploymentRequest(
                    model_id=MODEL,
                    config=common.DeploymentConfig(variant_name="z" + "q" * 100_000),
                ),
                metadata=_md(s.tokens["app-developer"]),
                timeout=60,
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "has no variant" in details
        assert len(details) < 300, len(details)


def test_health_list_answers_any_token(deployed):
    """Health/List is for any valid token (the policy); it answered INTERNAL, the
    library's servicer lacking it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    s = deployed
    for address, token in [
        *((s.settings.address(n), s.tokens["app-user"]) for n in ("model", "scheduler", "agent")),
        (s.worker_address, s.tokens["service"]),
    ]:
        with grpc.insecure_channel(address) as ch:
            listed = health_pb2_grpc.HealthStub(ch).List(
                health_pb2.HealthListRequest(), metadata=_md(token), timeout=30
            )
        assert listed.statuses[""].status == health_pb2.HealthCheckResponse.SERVING, address


def test_developers_change_only_what_they_own(deployed):
    s = deployed
    with grpc.insecure_channel(s.settings.address("deploy")) as ch:
        tokens = token_service_pb2_grpc.TokenServiceStub(ch)
        other_dev = tokens.CreateToken(
            token_pb.CreateTokenRequest(subject="otto", role=policy.APP_DEVELOPER),
            metadata=_md(s.tokens["admin"]),
        ).secret
        other_modeller = tokens.CreateToken(
            token_pb.CreateTokenRequest(subject="max", role=policy.MODEL_DEVELOPER),
            metadata=_md(s.tokens["admin"]),
        ).secret
        deployments = deployment_service_pb2_grpc.DeploymentServiceStub(ch)
        code = _code(
            lambda: deployments.RemoveDeployment(
                deploy_pb.RemoveDeploymentRequest(deployment_id=s.deployment_id),
                metadata=_md(other_dev),
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        still = deployments.GetDeployment(
            deploy_pb.GetDeploymentRequest(deployment_id=s.deployment_id),
            metadata=_md(s.tokens["admin"]),
        ).deployment
        assert still.state == deploy_pb.DEPLOYMENT_STATE_READY
    # Another developer may not generate on adam's deployment; adam may.
    assert _code(lambda: _generate(s, other_dev, deployment_id=s.deployment_id)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert _generate(s, s.tokens["app-developer"], deployment_id=s.deployment_id) > 0
    with s.channel("model") as ch:
        models = model_service_pb2_grpc.ModelServiceStub(ch)
        code = _code(
            lambda: models.DeleteModel(
                model_pb.DeleteModelRequest(model_id=MODEL), metadata=_md(other_modeller)
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        model = models.GetModel(
            model_pb.GetModelRequest(model_id=MODEL), metadata=_md(s.tokens["admin"])
        ).model
        assert model.owner == "mia"


def test_deployments_and_their_traffic_are_read_only_by_who_may_read_them(deployed):
    """The cluster's state carries deployment records only to the roles that may read
    deployments (a model developer sees devices, not whose deployments run there);
    serving statistics, another tenant's volumes and latencies, only to the owner."""
    s = deployed
    assert _generate(s, s.tokens["app-developer"], deployment_id=s.deployment_id) > 0
    other_dev = _new_token(s, "olga", policy.APP_DEVELOPER)
    with grpc.insecure_channel(s.settings.address("deploy")) as ch:
        deployments = deployment_service_pb2_grpc.DeploymentServiceStub(ch)

        def state(token: str) -> deploy_pb.GetClusterStateResponse:
            return deployments.GetClusterState(
                deploy_pb.GetClusterStateRequest(), metadata=_md(token)
            )

        def ids(reply: deploy_pb.GetClusterStateResponse) -> set[str]:
            on_devices = {i for n in reply.nodes for d in n.devices for i in d.deployment_ids}
            return {d.deployment_id for d in reply.deployments} | on_devices

        assert s.deployment_id in ids(state(s.tokens["admin"]))
        assert s.deployment_id in ids(state(other_dev))  # developers read every deployment
        as_modeller = state(s.tokens["model-developer"])
        assert as_modeller.nodes and not ids(as_modeller)
        # The same rule as ListDeployments, which the model developer may not call.
        refused = _code(
            lambda: deployments.ListDeployments(
                deploy_pb.ListDeploymentsRequest(), metadata=_md(s.tokens["model-developer"])
            )
        )
        assert refused == grpc.StatusCode.PERMISSION_DENIED
    with s.channel("scheduler") as ch:
        inference = inference_service_pb2_grpc.InferenceServiceStub(ch)

        def served(token: str) -> set[str]:
            reply = inference.GetServingStats(
                infer_pb.GetServingStatsRequest(), metadata=_md(token)
            )
            return {d.deployment_id for d in reply.deployments}

        assert s.deployment_id in served(s.tokens["admin"])
        assert s.deployment_id in served(s.tokens["app-developer"])
        assert s.deployment_id not in served(other_dev)


def test_users_generate_only_on_what_their_token_grants_until_revoked(deployed):
    s = deployed
    with grpc.insecure_channel(s.settings.address("deploy")) as ch:
        tokens = token_service_pb2_grpc.TokenServiceStub(ch)
        granted = tokens.CreateToken(
            token_pb.CreateTokenRequest(
                subject="app1", role=policy.APP_USER, deployments=[s.deployment_id]
            ),
            metadata=_md(s.tokens["admin"]),
        )
        elsewhere = tokens.CreateToken(
            token_pb.CreateTokenRequest(
                subject="app2", role=policy.APP_USER, deployments=["other-0000"]
            ),
            metadata=_md(s.tokens["admin"]),
        ).secret
        listed = tokens.ListTokens(token_pb.ListTokensRequest(), metadata=_md(s.tokens["admin"]))
        assert granted.token.token_id in {t.token_id for t in listed.tokens}
        assert granted.secret not in str(listed)  # secrets are never listed
        deployments = deployment_service_pb2_grpc.DeploymentServiceStub(ch)
        seen = deployments.ListDeployments(
            deploy_pb.ListDeploymentsRequest(), metadata=_md(elsewhere)
        )
        assert list(seen.deployments) == []
        seen = deployments.ListDeployments(
            deploy_pb.ListDeploymentsRequest(), metadata=_md(granted.secret)
        )
        assert [d.deployment_id for d in seen.deployments] == [s.deployment_id]

        assert _generate(s, granted.secret, deployment_id=s.deployment_id) > 0
        assert _generate(s, granted.secret, model_id=MODEL) > 0
        # A user learns nothing of what its token does not grant: a deployment, or a
        # model, it may not use answers as one that does not exist.
        for other, unknown, call in (
            (
                s.deployment_id,
                "other-0001",
                lambda t: _generate(s, elsewhere, deployment_id=t),
            ),
            (MODEL, "no-such-model", lambda t: _generate(s, elsewhere, model_id=t)),
            (
                s.deployment_id,
                "other-0001",
                lambda t: deployments.GetDeployment(
                    deploy_pb.GetDeploymentRequest(deployment_id=t), metadata=_md(elsewhere)
                ),
            ),
        ):
            missing = _refusal(lambda c=call, t=unknown: c(t), unknown)
            assert missing[0] == grpc.StatusCode.NOT_FOUND, missing
            assert _refusal(lambda c=call, t=other: c(t), other) == missing
        # A user token cannot deploy, register or issue tokens.
        assert (
            _code(
                lambda: deployments.Deploy(
                    deploy_pb.DeployRequest(model_id=MODEL), metadata=_md(granted.secret)
                )
            )
            == grpc.StatusCode.PERMISSION_DENIED
        )
        tokens.RevokeToken(
            token_pb.RevokeTokenRequest(token_id=granted.token.token_id),
            metadata=_md(s.tokens["admin"]),
        )
    # Each process trusts a checked token for a second (services.auth.tokens.CACHE_S).
    assert wait_for(
        lambda: (
            _code(lambda: _generate(s, granted.secret, deployment_id=s.deployment_id))
            == grpc.StatusCode.UNAUTHENTICATED
        ),
        timeout=5,
        interval=0.5,
    )


def _cli(s: AuthStack, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **s.env}
    env.pop("ISERVE_TOKEN", None)
    if token is not None:
        env["ISERVE_TOKEN"] = token
    return run_cli(env, *args, timeout=120)


def test_the_cli_issues_lists_and_revokes_tokens(deployed):
    s = deployed
    # Without ISERVE_TOKEN the CLI uses the stack's admin token file.
    made = _cli(
        s,
        "token",
        "create",
        "carla",
        "--role",
        "app-user",
        "--deployment",
        s.deployment_id,
        "--json",
    )
    assert made.returncode == 0, made.stderr
    assert "warning" not in made.stderr, made.stderr
    record = json.loads(made.stdout)
    assert record["role"] == "ROLE_APP_USER" and record["token"].startswith("isv_")
    # An id no deployment has (a typo, or one copied before `iserve deploy` chose it):
    # made, as the API takes it, and the CLI says the token cannot generate there.
    stray = _cli(
        s, "token", "create", "dora", "--role", "app-user", "--deployment", "demo-1a2b3c4d"
    )
    assert stray.returncode == 0, stray.stderr
    assert "warning: no deployment demo-1a2b3c4d exists" in stray.stderr, stray.stderr
    listed = _cli(s, "token", "list", "--json")
    assert record["token_id"] in listed.stdout and record["token"] not in listed.stdout
    denied = _cli(s, "models", token=record["token"])
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    generated = _cli(
        s, "generate", s.deployment_id, "hi", "--max-tokens", "3", token=record["token"]
    )
    assert generated.returncode == 0, generated.stderr
    assert _cli(s, "token", "revoke", record["token_id"]).returncode == 0
    refused = _cli(s, "models", token=record["token"])
    for _ in range(10):  # a checked token is trusted for a second (tokens.CACHE_S)
        if "UNAUTHENTICATED" in refused.stderr:
            break
        time.sleep(0.5)
        refused = _cli(s, "models", token=record["token"])
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    assert "ISERVE_TOKEN" in refused.stderr
    status = _cli(s, "status", "--json")  # the stack's admin token, every service answers
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["deployments"], status.stdout
    before = _cli(s, "token", "list", "--json").stdout
    bad_revoke = _cli(s, "token", "revoke", "x:y")
    assert bad_revoke.returncode == 1 and "INVALID_ARGUMENT" in bad_revoke.stderr
    assert _cli(s, "token", "list", "--json").stdout == before  # nothing revoked
    # A token revoked by pasting the token itself (a leaked one): the CLI reads its id
    # and sends only that. The secret had been refused and written into deploy.log.
    leaked = json.loads(_cli(s, "token", "create", "erin", "--role", "admin", "--json").stdout)
    by_token = _cli(s, "token", "revoke", leaked["token"])
    assert by_token.returncode == 0, by_token.stderr
    assert by_token.stdout.strip() == f"revoked {leaked['token_id']}"
    logs = s.settings.state_dir / "logs"
    secret = leaked["token"].split("_", 2)[2]
    assert not any(secret in p.read_text(errors="replace") for p in logs.glob("*.log"))
    before = _cli(s, "token", "list", "--json").stdout
    # The stack's own tokens, in use by every service and the CLI: refused, with the
    # way to rotate them, and nothing revoked.
    own = {t["subject"]: t["token_id"] for t in map(json.loads, before.splitlines())}
    for subject, setting in (("iserve", "ISERVE_SERVICE_TOKEN"), ("admin", "ISERVE_ADMIN_TOKEN")):
        kept = _cli(s, "token", "revoke", own[subject])
        assert kept.returncode == 1 and "FAILED_PRECONDITION" in kept.stderr, kept.stderr
        assert setting in kept.stderr and "restart" in kept.stderr, kept.stderr
    assert _cli(s, "token", "list", "--json").stdout == before
    assert _cli(s, "status", "--json").returncode == 0
    # A model developer may not read serving stats: left out with a note, and the
    # status exits 0 while every service answers (it exited 1, "PERMISSION_DENIED").
    developer = _cli(s, "status", token=s.tokens["model-developer"])
    assert developer.returncode == 0, developer.stderr
    assert "error:" not in developer.stderr, developer.stderr
    assert "note: not shown to this token: scheduler: serving stats: " in developer.stderr
    bad = _cli(s, "token", "create", "x y", "--role", "admin")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr


def test_the_gateway_forwards_the_client_token(deployed):
    s = deployed
    base = f"http://{s.settings.gateway_address}/v1"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        missing = client.post(f"{base}/completions", json=body)
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        assert missing.headers["www-authenticate"] == 'Bearer realm="iserve"'
        # With a trailing slash too: no 307 to the path without it before the token
        # was checked (a tester); with a token, a 404 that says what to send.
        slashed = client.post(f"{base}/completions/", json=body)
        assert slashed.status_code == 401, slashed.text
        slashed = client.post(
            f"{base}/completions/",
            json=body,
            headers={"Authorization": f"Bearer {s.tokens['app-user']}"},
        )
        assert slashed.status_code == 404, slashed.text
        assert slashed.json()["error"]["message"] == (
            "Not Found: '/v1/completions/': send it without the trailing slash"
        )
        wrong = client.post(
            f"{base}/completions", json=body, headers={"Authorization": "Bearer nope-nope"}
        )
        assert wrong.status_code == 401
        dev = client.post(
            f"{base}/completions",
            json=body,
            headers={"Authorization": f"Bearer {s.tokens['model-developer']}"},
        )
        assert dev.status_code == 403
        ok = client.post(
            f"{base}/completions",
            json=body,
            headers={"Authorization": f"Bearer {s.tokens['app-user']}"},
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 3
        models = client.get(
            f"{base}/models", headers={"Authorization": f"Bearer {s.tokens['app-user']}"}
        )
        assert [m["id"] for m in models.json()["data"]] == [MODEL]
        # A model developer generates on nothing: a 403 in the caller's own terms, not
        # the internal method's (it named DeploymentService/ListDeployments, a tester).
        # Nor does a service token, which calls workers: it was shown every model, each
        # of which then refused it generation (a tester).
        for role in ("model-developer", "service"):
            for path in ("/models", f"/models/{MODEL}"):
                refused = client.get(
                    f"{base}{path}", headers={"Authorization": f"Bearer {s.tokens[role]}"}
                )
                assert refused.status_code == 403, (role, refused.text)
                assert refused.json()["error"]["message"] == (
                    "this token may not list models: GET /v1/models is for admin, "
                    "app-developer, app-user tokens"
                )
        # Nor chats (its 403 named ListDeployments too, which the gateway calls first).
        chat = client.post(
            f"{base}/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {s.tokens['model-developer']}"},
        )
        assert chat.status_code == 403, chat.text
        assert chat.json()["error"]["message"] == (
            "this token may not generate: chat completions are for admin, app-developer, "
            "app-user tokens"
        )


def test_the_gateway_lists_only_models_the_key_may_generate_on(deployed):
    """An application developer reads every deployment but generates only on its own:
    /v1/models listed another developer's model, on which every generation then got 403
    (clients that pick a model from the list failed)."""
    s = deployed
    other = _new_token(s, "olga", policy.APP_DEVELOPER)
    base = f"http://{s.settings.gateway_address}/v1"

    def get(path: str, token: str) -> httpx.Response:
        return httpx.get(f"{base}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=30)

    assert [m["id"] for m in get("/models", s.tokens["app-developer"]).json()["data"]] == [MODEL]
    assert get("/models", other).json()["data"] == []
    assert get(f"/models/{MODEL}", other).status_code == 404
    assert get(f"/models/{MODEL}", s.tokens["app-developer"]).status_code == 200


def _chat(s: AuthStack, token: str, model: str) -> httpx.Response:
    # ignore_eos: a random model may sample its end-of-text token before max_tokens.
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "ignore_eos": True,
    }
    return httpx.post(
        f"http://{s.settings.gateway_address}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )


def test_a_gateway_chat_tells_of_no_model_the_caller_may_not_use(deployed):
    """The chat template is read with the gateway's own token: before, any token (or none
    the services accept) learned which models are registered and which have a template,
    and made the gateway read their checkpoints."""
    s = deployed
    plain = "auth-plain"  # registered, no chat template, no deployment
    create_checkpoint(s.settings.models_root / plain, **TINY, chat_template=None, overwrite=True)
    with s.channel("model") as ch:
        models = model_service_pb2_grpc.ModelServiceStub(ch)
        models.RegisterModel(
            model_pb.RegisterModelRequest(
                model_id=plain, checkpoint_path=plain, skip_profiling=True
            ),
            metadata=_md(s.tokens["model-developer"]),
        )
        try:
            with grpc.insecure_channel(s.settings.address("deploy")) as deploy_ch:
                elsewhere = (
                    token_service_pb2_grpc.TokenServiceStub(deploy_ch)
                    .CreateToken(
                        token_pb.CreateTokenRequest(
                            subject="app3", role=policy.APP_USER, deployments=["other-0000"]
                        ),
                        metadata=_md(s.tokens["admin"]),
                    )
                    .secret
                )
            forged = "isv_0123456789abcdef_" + "A" * 43  # a token's shape, not a token
            # The services refuse it before the gateway reads a body (a 400 for this one
            # came first: a made-up token had 30 MB bodies parsed and validated).
            for path in ("chat/completions", "completions"):
                refused = httpx.post(
                    f"http://{s.settings.gateway_address}/v1/{path}",
                    json={"model": MODEL, "messages": "not a list", "prompt": [-1]},
                    headers={"Authorization": f"Bearer {forged}"},
                    timeout=60,
                )
                assert refused.status_code == 401, refused.text
                assert refused.json()["error"]["message"] == "invalid or revoked token"
            for model in (MODEL, plain, "auth-unknown"):
                refused = _chat(s, forged, model)
                assert refused.status_code == 401, refused.text
                assert refused.json()["error"] == {
                    "message": "invalid or revoked token",
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
                # A user whose token grants none of its deployments: as if unknown.
                hidden = _chat(s, elsewhere, model)
                assert hidden.status_code == 404, hidden.text
                assert hidden.json()["error"]["message"] == f"model {model} has no deployment"
            # Not the template's 400: a model without a deployment is not served.
            for role in ("app-user", "admin"):
                missing = _chat(s, s.tokens[role], plain)
                assert missing.status_code == 404, missing.text
                assert missing.json()["error"]["message"] == f"model {plain} has no deployment"
            # A model developer sees no deployment (nor may it generate).
            assert _chat(s, s.tokens["model-developer"], MODEL).status_code == 403
            served = _chat(s, s.tokens["app-user"], MODEL)
            assert served.status_code == 200, served.text
            assert served.json()["usage"]["completion_tokens"] == 2
        finally:
            models.DeleteModel(
                model_pb.DeleteModelRequest(model_id=plain),
                metadata=_md(s.tokens["model-developer"]),
            )


@pytest.mark.parametrize(
    "header",
    [
        b"Bearer \xe9" + b"a" * 40,  # a 500 before: gRPC metadata is ASCII
        b"Bearer " + b"a" * 60_000,  # a 429 naming gRPC internals: the metadata limit
        b"Bearer short",  # no token is under 24 characters
    ],
    ids=["latin-1", "60KB", "short"],
)
def test_the_gateway_refuses_what_cannot_be_a_token_with_a_401(deployed, header):
    s = deployed
    base = f"http://{s.settings.gateway_address}/v1"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with httpx.Client(timeout=60, headers=[(b"authorization", header)]) as client:
        replies = [
            client.get(f"{base}/models"),
            client.post(f"{base}/completions", json=body),
            client.post(
                f"{base}/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            ),
        ]
    for reply in replies:
        assert reply.status_code == 401, reply.text
        error = reply.json()["error"]
        assert error["type"] == "authentication_error"
        assert error["message"].startswith("the bearer token is not an iserve token (24-512 ")
        assert reply.headers["www-authenticate"] == 'Bearer realm="iserve"'


def test_two_authorization_entries_are_refused_on_both_paths(deployed):
    """gRPC took the first Bearer entry and the gateway the first header: a proxy in
    front acting on the last would authorize another principal than iserve does."""
    s = deployed
    alice, admin = s.tokens["app-user"], s.tokens["admin"]
    two = (("authorization", f"Bearer {alice}"), ("authorization", f"Bearer {admin}"))
    with grpc.insecure_channel(s.settings.address("deploy")) as channel:
        stub = deployment_service_pb2_grpc.DeploymentServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListDeployments(deploy_pb.ListDeploymentsRequest(), metadata=two, timeout=30)
        basic = (("authorization", "Basic eDp5"), ("authorization", f"Bearer {admin}"))
        with pytest.raises(grpc.RpcError) as refused_basic:
            stub.ListDeployments(deploy_pb.ListDeploymentsRequest(), metadata=basic, timeout=30)
    for error in (refused.value, refused_basic.value):
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "more than one `authorization` entry" in error.details()
    base = f"http://{s.settings.gateway_address}/v1"
    headers = [(b"authorization", f"Bearer {alice}".encode())] * 2
    with httpx.Client(timeout=60, headers=headers) as client:
        reply = client.get(f"{base}/models")
    assert reply.status_code == 401 and "more than one Authorization header" in reply.text
    with httpx.Client(timeout=60, headers=headers[:1]) as client:
        assert client.get(f"{base}/models").status_code == 200


def test_metrics_answer_only_admin_and_service_tokens(deployed):
    s = deployed
    url = f"http://{s.settings.metrics_address('scheduler')}/metrics"

    def status(token: str) -> int:
        request = urllib.request.Request(
            url, headers=dict(_md(token)) and {"Authorization": f"Bearer {token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert status("") == 401
    assert status(s.tokens["app-user"]) == 401
    assert status(s.tokens["service"]) == 200
    assert status(s.tokens["admin"]) == 200


def test_profiling_runs_on_service_tokens(auth_stack):
    """Registering profiles the fingerprints: model service -> agent -> profiling workers,
    every hop carrying the service token."""
    s = auth_stack
    create_checkpoint(s.settings.models_root / "auth-prof", **TINY, overwrite=True)
    with s.channel("model") as ch:
        models = model_service_pb2_grpc.ModelServiceStub(ch)
        models.RegisterModel(
            model_pb.RegisterModelRequest(model_id="auth-prof", checkpoint_path="auth-prof"),
            metadata=_md(s.tokens["model-developer"]),
        )
        events = list(
            models.WatchModel(
                model_pb.WatchModelRequest(model_id="auth-prof"),
                metadata=_md(s.tokens["model-developer"]),
                timeout=300,
            )
        )
    assert events[-1].state == model_pb.MODEL_STATE_PROFILED, events[-1]


def test_the_node_client_sends_iserve_token(auth_stack, tmp_path):
    """clients/node with authentication on: refused without a token, served with
    ISERVE_TOKEN, or with the admin token `iserve up` wrote into the state directory (as
    the Python CLI takes it)."""
    from tests.integration.test_node_client import CLIENT

    node = shutil.which("node")
    if node is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the Node client")
    lock = CLIENT / "package-lock.json"
    installed = CLIENT / "node_modules" / ".package-lock.json"
    if not installed.is_file() or installed.stat().st_mtime < lock.stat().st_mtime:
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=CLIENT, check=True, timeout=300
        )
    s = auth_stack
    create_checkpoint(s.settings.models_root / "auth-node", **TINY, overwrite=True)
    env = {**os.environ, **s.env}
    env.pop("ISERVE_TOKEN", None)
    elsewhere = {**env, "ISERVE_STATE_DIR": str(tmp_path)}  # no token files there
    command = [node, str(CLIENT / "demo.js"), "auth-node", "auth-node", "hi", "--max-tokens", "4"]
    refused = subprocess.run(command, env=elsewhere, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr + refused.stdout
    for given in ({**elsewhere, "ISERVE_TOKEN": s.tokens["admin"]}, env):
        served = subprocess.run(command, env=given, capture_output=True, text=True, timeout=240)
        assert served.returncode == 0, served.stderr + served.stdout
        assert "deployed auth-node-" in served.stdout and "removed auth-node-" in served.stdout


def test_refused_callers_are_logged_and_named_without_their_token(deployed):
    s = deployed
    wrong = "not-a-real-token-but-long-enough-0123456789"
    with s.channel("deploy") as ch:
        stub = deployment_service_pb2_grpc.DeploymentServiceStub(ch)
        for _ in range(3):  # a client retrying: one line
            code, _ = _refusal(
                lambda: stub.GetClusterState(
                    deploy_pb.GetClusterStateRequest(), metadata=_md(wrong)
                )
            )
            assert code == grpc.StatusCode.UNAUTHENTICATED
    base = f"http://{s.settings.gateway_address}/v1"
    with httpx.Client(timeout=60) as client:
        reply = client.get(f"{base}/models", headers={"authorization": f"Basic {wrong}"})
    assert reply.status_code == 401
    assert reply.json()["error"]["message"].startswith(
        "the Authorization header is not `Bearer <token>`"
    )
    logs = s.settings.state_dir / "logs"

    def logged() -> str:
        return "".join(p.read_text(errors="replace") for p in logs.glob("*.log"))

    assert wait_for(lambda: "GetClusterState from 127.0.0.1: invalid or revoked token" in logged())
    assert wait_for(lambda: "the Authorization header is not `Bearer <token>`" in logged())
    text = logged()
    assert text.count("/iserve.v1.DeploymentService/GetClusterState from 127.0.0.1: invalid") == 1
    assert wrong not in text


def test_a_deployment_id_as_the_model_serves_only_a_token_that_may_use_it(deployed):
    """With the gateway's `model` naming a deployment (it pins the request there), a user
    token that grants it generates, and one that does not is told what an unknown model
    gets: nothing says the deployment exists."""
    s = deployed
    with s.channel("deploy") as ch:
        stub = token_service_pb2_grpc.TokenServiceStub(ch)
        granted, elsewhere = (
            stub.CreateToken(
                token_pb.CreateTokenRequest(subject=subject, role=policy.APP_USER, deployments=[d]),
                metadata=_md(s.tokens["admin"]),
            ).secret
            for subject, d in (("pinned", s.deployment_id), ("elsewhere", "other-0000"))
        )
    base = f"http://{s.settings.gateway_address}/v1"
    for path, extra in (
        ("completions", {"prompt": "hi"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        body = {"model": s.deployment_id, "max_tokens": 2, "ignore_eos": True, **extra}
        replies = {
            name: httpx.post(
                f"{base}/{path}",
                json=body,
                headers={"Authorization": f"Bearer {token}"},
                timeout=60,
            )
            for name, token in (("granted", granted), ("elsewhere", elsewhere))
        }
        assert replies["granted"].status_code == 200, (path, replies["granted"].text)
        assert replies["granted"].json()["usage"]["completion_tokens"] == 2
        refused = replies["elsewhere"]
        assert refused.status_code == 404, (path, refused.text)
        unknown = httpx.post(
            f"{base}/{path}",
            json={**body, "model": "no-such-model-0000beef"},  # a deployment id's shape
            headers={"Authorization": f"Bearer {elsewhere}"},
            timeout=60,
        )
        assert refused.json()["error"]["message"] == unknown.json()["error"]["message"].replace(
            "no-such-model-0000beef", s.deployment_id
        ), (refused.text, unknown.text)
