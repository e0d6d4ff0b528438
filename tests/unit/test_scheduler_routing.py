"""Router against an in-memory stand-in for StateStore that counts its reads."""

from __future__ import annotations

import asyncio
import re

import pytest

from scheduler_svc.routing import Router
from services.aio import cancel_and_wait
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.auth import access, policy
from services.auth.tokens import Principal
from services.errors import (
    FailedPrecondition,
    InvalidArgument,
    ModelNotFound,
    NotFound,
    PermissionDenied,
    Unavailable,
)

READY = deploy_pb.DEPLOYMENT_STATE_READY


class CountingStore:
    """The two StateStore reads the router uses, from a dict."""

    def __init__(self, *deployments: deploy_pb.Deployment):
        self.records = {d.deployment_id: d for d in deployments}
        self.reads = 0

    async def get_deployment(self, deployment_id: str) -> deploy_pb.Deployment | None:
        self.reads += 1
        found = self.records.get(deployment_id)
        return None if found is None else deploy_pb.Deployment.FromString(found.SerializeToString())

    async def list_deployments(self, model_id: str = "") -> list[deploy_pb.Deployment]:
        self.reads += 1
        return [
            deploy_pb.Deployment.FromString(d.SerializeToString())
            for d in self.records.values()
            if not model_id or d.model_id == model_id
        ]


def deployment(deployment_id: str, state: int = READY, model_id: str = "m", reason: str = ""):
    return deploy_pb.Deployment(
        deployment_id=deployment_id,
        model_id=model_id,
        state=state,
        state_reason=reason,
        worker_address="127.0.0.1:1",
        config=common.DeploymentConfig(batch_size=1),
    )


def test_cached_ready_deployment_costs_no_redis_read():
    async def scenario():
        store = CountingStore(deployment("d1"))
        router = Router(store, backlog=lambda _deployment: 0.0)
        assert (await router.by_deployment_id("d1")).deployment_id == "d1"
        assert store.reads == 1  # the miss
        for _ in range(100):
            await router.by_deployment_id("d1")
        assert store.reads == 1

    asyncio.run(scenario())


def test_not_ready_cached_record_is_reread_from_redis():
    async def scenario():
        store = CountingStore(deployment("d1", deploy_pb.DEPLOYMENT_STATE_STARTING))
        router = Router(store, backlog=lambda _deployment: 0.0)
        with pytest.raises(Unavailable, match="^deployment d1 is STARTING$"):
            await router.by_deployment_id("d1")
        store.records["d1"] = deployment("d1")
        assert (await router.by_deployment_id("d1")).state == READY

    asyncio.run(scenario())


def test_forget_makes_the_next_request_read_redis():
    async def scenario():
        store = CountingStore(deployment("d1"))
        router = Router(store, backlog=lambda _deployment: 0.0)
        await router.refresh()
        reads = store.reads
        await router.by_deployment_id("d1")
        assert store.reads == reads
        router.forget("d1")
        store.records["d1"] = deployment("d1", deploy_pb.DEPLOYMENT_STATE_FAILED, reason="gone")
        with pytest.raises(FailedPrecondition, match="^deployment d1 is FAILED: gone$") as failed:
            await router.by_deployment_id("d1")
        # The server's state, not the request's fault: the gateway's 503, not a 400.
        assert failed.value.reason == "deployment_not_serving"
        del store.records["d1"]
        with pytest.raises(NotFound, match="deployment d1 not found"):
            await router.by_deployment_id("d1")

    asyncio.run(scenario())


def test_model_routing_picks_the_shortest_expected_wait_among_ready_deployments():
    async def scenario():
        store = CountingStore(
            deployment("a"),
            deployment("b"),
            deployment("c", deploy_pb.DEPLOYMENT_STATE_STARTING),
            deployment("other", model_id="m2"),
        )
        wait_s = {"a": 2.0, "b": 0.5, "c": 0.0}
        router = Router(store, backlog=lambda d: wait_s.get(d.deployment_id, 0.0))
        assert (await router.by_model_id("m")).deployment_id == "b"
        wait_s["b"] = 3.0
        assert (await router.by_model_id("m")).deployment_id == "a"
        assert store.reads == 1  # one full refresh, then the cache

    asyncio.run(scenario())


def test_a_deployment_id_given_as_the_model_pins_the_request_to_it():
    """Two deployments of one model (another compression each) answered a model's
    request in turn; over HTTP, where `model` is the only field, a deployment's id was
    refused ("ask for that model"), so no request could choose (a probe)."""

    async def scenario():
        store = CountingStore(deployment("fast"), deployment("exact"))
        waits = {"fast": 0.0, "exact": 5.0}
        router = Router(store, backlog=lambda d: waits[d.deployment_id])
        assert (await router.by_model_id("m")).deployment_id == "fast"
        assert [d.deployment_id for d in await router.ranked_for_model("exact")] == ["exact"]
        reads = store.reads
        for _ in range(10):  # cached, as by id
            assert (await router.by_model_id("exact")).deployment_id == "exact"
        assert store.reads == reads

    asyncio.run(scenario())


def test_model_routing_errors_name_the_states():
    async def scenario():
        store = CountingStore(
            deployment("x", deploy_pb.DEPLOYMENT_STATE_FAILED, reason="OOM"),
            deployment("y", deploy_pb.DEPLOYMENT_STATE_FAILED, model_id="n"),
            deployment("z", deploy_pb.DEPLOYMENT_STATE_REMOVING, model_id="n"),
        )
        router = Router(store, backlog=lambda _deployment: 0.0)
        with pytest.raises(FailedPrecondition) as failure:
            await router.by_model_id("m")
        assert str(failure.value) == "model m has no READY deployment (deployment x is FAILED: OOM)"
        assert failure.value.reason == "deployment_not_serving"
        # One being removed may have a successor starting (remove, then deploy again).
        with pytest.raises(Unavailable) as passing:
            await router.by_model_id("n")
        assert str(passing.value) == (
            "model n has no READY deployment (deployment y is FAILED; deployment z is REMOVING)"
        )
        with pytest.raises(NotFound, match="model nothing has no deployment"):
            await router.by_model_id("nothing")
        # A deployment's id where a model's goes (the gateway's `model`) names that
        # deployment: its state is what is said (it said "ask for model m", and HTTP
        # could not pin a request to one of a model's deployments).
        with pytest.raises(FailedPrecondition, match="^deployment x is FAILED: OOM$"):
            await router.by_model_id("x")

    asyncio.run(scenario())


def test_a_deployment_being_restarted_is_unavailable_not_failed_precondition():
    """Restarting (deploy_svc.healer: STARTING with a reason) and a Deploy still in
    progress (STARTING) are worth a retry: 503 to an OpenAI client, which retries it, not
    400, which it does not."""

    async def scenario():
        restarting = "restart 1 in 1 s after: worker rank 0 exited (-9)"
        store = CountingStore(
            deployment("r", deploy_pb.DEPLOYMENT_STATE_STARTING, reason=restarting),
            deployment("s", deploy_pb.DEPLOYMENT_STATE_STARTING, model_id="other"),
        )
        router = Router(store, backlog=lambda _deployment: 0.0)
        with pytest.raises(
            Unavailable, match=f"^deployment r is STARTING: {re.escape(restarting)}$"
        ):
            await router.by_deployment_id("r")
        with pytest.raises(Unavailable, match="^model m has no READY deployment"):
            await router.by_model_id("m")
        with pytest.raises(Unavailable, match="^deployment s is STARTING$"):
            await router.by_deployment_id("s")
        with pytest.raises(Unavailable, match="^model other has no READY deployment"):
            await router.by_model_id("other")

    asyncio.run(scenario())


def test_a_user_is_refused_what_its_token_does_not_grant_as_if_it_did_not_exist():
    """docs/security.md: an app-user sees only the deployments its token grants, so one
    it may not use, or a model with none it may use, answers as an unknown one does."""

    async def refusal(route, target: str) -> tuple[type, str]:
        with pytest.raises((NotFound, PermissionDenied)) as refused:
            await route(target)
        return type(refused.value), str(refused.value).replace(target, "<id>")

    async def scenario():
        store = CountingStore(
            deployment("d1"),
            deployment("d2", model_id="m2"),
            deployment("d3", deploy_pb.DEPLOYMENT_STATE_STARTING, model_id="m3"),
            deployment("m2-89abcdef", model_id="m2"),
        )
        for record in store.records.values():
            record.owner = "carol"
        router = Router(store, backlog=lambda _deployment: 0.0)
        token = access.set_caller(Principal("t1", "app", policy.APP_USER, ("d1",)))
        try:
            assert (await router.by_deployment_id("d1")).deployment_id == "d1"
            assert (await router.by_model_id("m")).deployment_id == "d1"
            unknown = await refusal(router.by_deployment_id, "d9")
            assert unknown == (NotFound, "deployment <id> not found")
            for target in ("d2", "d3"):
                assert await refusal(router.by_deployment_id, target) == unknown
            unknown = await refusal(router.by_model_id, "m9")
            assert unknown == (ModelNotFound, "model <id> has no deployment")
            for target in ("m2", "m3"):  # READY, and only STARTING
                assert await refusal(router.by_model_id, target) == unknown
            # A deployment's id given as the model's: the one granted serves, the others
            # answer as a model with no deployment (not "deployment … not found").
            assert (await router.by_model_id("d1")).deployment_id == "d1"
            for target in ("d2", "d3"):
                assert await refusal(router.by_model_id, target) == unknown
            # A deployment id's shape (a removed one's, pinned by a client) is told it
            # names no deployment either, whether one is hidden under it or none is.
            shaped = await refusal(router.by_model_id, "m-0123abcd")
            assert shaped == (
                ModelNotFound,
                "model <id> has no deployment, and no deployment has that id",
            )
            assert await refusal(router.by_model_id, "m2-89abcdef") == shaped
        finally:
            access.reset_caller(token)
        # A developer may list every deployment: it is told it may not use another's.
        token = access.set_caller(Principal("t2", "otto", policy.APP_DEVELOPER))
        try:
            assert (await refusal(router.by_deployment_id, "d2"))[0] is PermissionDenied
            assert (await refusal(router.by_model_id, "m2"))[0] is PermissionDenied
        finally:
            access.reset_caller(token)

    asyncio.run(scenario())


def test_ids_that_cannot_be_keys_are_invalid():
    async def scenario():
        router = Router(CountingStore(), backlog=lambda _deployment: 0.0)
        with pytest.raises(InvalidArgument, match="invalid deployment_id 'a:b'"):
            await router.by_deployment_id("a:b")

    asyncio.run(scenario())


def test_refresh_forever_survives_redis_failures():
    async def scenario():
        store = CountingStore(deployment("d1"))
        calls = []

        async def failing_list(model_id: str = ""):
            calls.append(model_id)
            if len(calls) < 3:
                raise ConnectionError("redis down")
            return [deployment("d1")]

        store.list_deployments = failing_list
        router = Router(store, backlog=lambda _deployment: 0.0)
        task = asyncio.create_task(router.refresh_forever(interval_s=0.001))
        async with asyncio.timeout(5):
            while not router.deployments():
                await asyncio.sleep(0.001)
        await cancel_and_wait([task])
        assert len(calls) >= 3

    asyncio.run(scenario())
