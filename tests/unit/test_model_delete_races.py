"""DeleteModel against Deploy and ImportProfiles running at the same time: one of a
delete and a deploy of the same model fails, and neither race leaves a key behind."""

from __future__ import annotations

import asyncio
import types

import grpc
import pytest

from deploy_svc.controller import ModelBeingDeleted
from fingerprint_svc.servicer import DELETE_MARK_TTL_S, ModelServicer
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from services.errors import FailedPrecondition
from services.state import keys as state_keys
from services.state.store import StateStore
from tests.unit.test_deploy_replicas import (
    FakeAgent,
    controller_on,
    deploy_request,
    nothing_left,
)
from tests.unit.test_estimator_import import DATA_SET, request

READY = deploy_pb.DEPLOYMENT_STATE_READY


class IdleProfiler:
    """A profiler with nothing running."""

    def running(self, model_id: str) -> bool:
        return False

    async def cancel(self, model_id: str) -> None:
        pass

    async def forget(self, model, remaining) -> int:
        return 0


def model_service(store: StateStore) -> ModelServicer:
    return ModelServicer(types.SimpleNamespace(models_root=None), store, IdleProfiler())


def delete(model_id: str) -> model_pb.DeleteModelRequest:
    return model_pb.DeleteModelRequest(request_id="del", model_id=model_id)


def pause_before(store: StateStore, method: str) -> tuple[asyncio.Event, asyncio.Event]:
    """Make ``store.method`` wait for the second event once it has set the first."""
    reached, go = asyncio.Event(), asyncio.Event()
    original = getattr(store, method)

    async def paused(*args, **kwargs):
        reached.set()
        await go.wait()
        return await original(*args, **kwargs)

    setattr(store, method, paused)
    return reached, go


async def keys_of(store: StateStore, model_id: str) -> list[str]:
    """The keys whose names hold ``model_id`` (the stack's state-format key aside: "m"
    is in its name too)."""
    found = [k async for k in store.redis.scan_iter(match=f"*{model_id}*")]
    return [k for k in found if k != state_keys.state_format()]


async def two_processes(store: StateStore, redis_url: str):
    """A deployment controller on ``store`` and a model service on a store of its own,
    as the two services run: separate processes sharing Redis."""
    agent = FakeAgent()
    controller = await controller_on(store, agent, 2)
    return agent, controller, model_service(StateStore.from_url(redis_url))


def test_a_deploy_while_a_delete_checks_fails_and_leaves_nothing(run, redis_url):
    """DeleteModel found no deployment and has not deleted yet when Deploy records its
    own: Deploy sees the delete's mark, rolls back and says so; the delete goes on."""

    async def scenario(store):
        agent, controller, models = await two_processes(store, redis_url)
        reached, go = pause_before(models.store, "delete_model")
        deleting = asyncio.create_task(models.DeleteModel(delete("m"), None))
        await reached.wait()
        with pytest.raises(ModelBeingDeleted, match=r"^model 'm' is being deleted$") as failure:
            await controller.deploy(deploy_request(1, request_id="req-1"))
        assert failure.value.code == grpc.StatusCode.FAILED_PRECONDITION
        go.set()
        await deleting
        assert agent.started == []  # rolled back before any worker started
        assert await nothing_left(store)
        assert await store.deploy_request("req-1") is None
        assert await keys_of(store, "m") == []  # no record, profile or mark
        await models.store.close()

    run(scenario)


def test_a_deploy_and_a_delete_within_milliseconds_refuse_only_one(run, redis_url):
    """DeleteModel has marked the model and not yet looked for deployments when Deploy
    comes: Deploy is refused, and records nothing the delete could then find. It recorded
    its deployment, then looked for the mark, and rolled back: a delete that looked in
    between was refused too, and neither happened (a tester, deploy and delete 1-6 ms
    apart)."""

    async def scenario(store):
        agent, controller, models = await two_processes(store, redis_url)
        marked, look = pause_before(models.store, "list_deployments")
        deleting = asyncio.create_task(models.DeleteModel(delete("m"), None))
        await marked.wait()
        rolling_back, roll_back = pause_before(controller, "_roll_back")
        deploying = asyncio.create_task(controller.deploy(deploy_request(1)))
        await rolling_back.wait()
        look.set()
        await deleting  # not refused: no deployment was recorded
        roll_back.set()
        with pytest.raises(ModelBeingDeleted, match=r"^model 'm' is being deleted$"):
            await deploying
        assert agent.started == []
        assert await nothing_left(store)
        assert await keys_of(store, "m") == []
        await models.store.close()

    run(scenario)


def test_a_delete_while_a_deploy_starts_is_refused_and_the_deploy_goes_on(run, redis_url):
    async def scenario(store):
        agent, controller, models = await two_processes(store, redis_url)
        agent.gate = asyncio.Event()  # the workers start once the delete has answered
        deploying = asyncio.create_task(controller.deploy(deploy_request(1)))
        while not agent.started:
            await asyncio.sleep(0.01)
        with pytest.raises(FailedPrecondition, match=r"^model 'm' has deployments \(m-\w+\); "):
            await models.DeleteModel(delete("m"), None)
        agent.gate.set()
        dep = (await deploying).deployment
        assert dep.state == READY
        # The refused delete left no mark: the model deploys again, and deletes once
        # its deployments are removed.
        assert await keys_of(store, "m:deleting") == []
        second = (await controller.deploy(deploy_request(1))).deployment
        for deployment_id in (dep.deployment_id, second.deployment_id):
            await controller.remove(deployment_id)
        await models.DeleteModel(delete("m"), None)
        assert await nothing_left(store)
        assert await keys_of(store, "m") == []
        await models.store.close()

    run(scenario)


def test_a_failed_deployment_also_keeps_its_model(run, redis_url):
    """A model registered again under the id would otherwise inherit the record."""

    async def scenario(store):
        _, controller, models = await two_processes(store, redis_url)
        dep = (await controller.deploy(deploy_request(1))).deployment
        await controller.mark_failed(dep, "gone")
        with pytest.raises(FailedPrecondition, match=r"has deployments \(m-\w+\); remove"):
            await models.DeleteModel(delete("m"), None)
        assert await store.get_model("m") is not None
        await models.store.close()

    run(scenario)


def test_a_crashed_deletes_mark_expires_and_blocks_deploys_meanwhile(run, redis_url):
    async def scenario(store):
        _, controller, models = await two_processes(store, redis_url)
        await store.mark_model_deleting("m", DELETE_MARK_TTL_S)
        assert 0 < await store.redis.pttl("iserve:model:m:deleting") <= DELETE_MARK_TTL_S * 1000
        with pytest.raises(ModelBeingDeleted):
            await controller.deploy(deploy_request(1))
        assert await nothing_left(store)
        await models.store.close()

    run(scenario)


def test_a_delete_during_an_import_waits_for_it_and_leaves_no_profile(run, redis_url):
    """ImportProfiles writes record, profile and sources in steps; a DeleteModel between
    them used to leave the profile to the next model registered under the id."""

    async def scenario(store):
        models = model_service(store)
        await models.ImportProfiles(request(DATA_SET), None)
        reached, go = pause_before(store, "put_profile")
        importing = asyncio.create_task(models.ImportProfiles(request(DATA_SET), None))
        await reached.wait()
        deleting = asyncio.create_task(models.DeleteModel(delete("llama-2-7b"), None))
        await asyncio.sleep(0.2)  # time for the delete to finish, if nothing held it
        go.set()
        await importing
        await deleting
        assert [m.model_id for m in await store.list_models()] == ["gptj-6b"]
        assert await keys_of(store, "llama-2-7b") == []

    run(scenario)
