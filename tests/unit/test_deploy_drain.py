"""The deployment service's stop, over a real gRPC server: a call that comes while it
drains is refused as draining (it was "connection refused", as from a dead server), a
Deploy still running when the drain is over is cut off, rolls back and answers with its
deployment id (it was "Cancelling all calls"), and one that ends within the drain is
answered as usual."""

from __future__ import annotations

import asyncio
import contextlib
import re

import grpc
import pytest

from deploy_svc.servicer import DeploymentServicer
from services.api import deployment_service_pb2 as deploy_pb
from services.api import deployment_service_pb2_grpc as deploy_grpc
from services.grpc_server import ServiceBinding, start_server
from tests.unit.test_deploy_replicas import (
    FakeAgent,
    controller_on,
    deploy_request,
    nothing_left,
)

READY = deploy_pb.DEPLOYMENT_STATE_READY


@contextlib.asynccontextmanager
async def deploy_held_at_start(store):
    """The servicer on a real server on a free port, and a Deploy through it (a client's
    channel) held where its workers start: (servicer, agent, the Deploy's call)."""
    agent = FakeAgent()
    agent.gate = asyncio.Event()
    servicer = DeploymentServicer(await controller_on(store, agent, 2))
    binding = ServiceBinding(
        servicer,
        deploy_grpc.add_DeploymentServiceServicer_to_server,
        "iserve.v1.DeploymentService",
    )
    server, port, _ = await start_server([binding], "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = deploy_grpc.DeploymentServiceStub(channel).Deploy(deploy_request(1), timeout=30)
        while not agent.started:
            await asyncio.sleep(0.01)
        yield servicer, agent, call, deploy_grpc.DeploymentServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(0)


def test_a_deploy_still_running_after_the_drain_is_cut_off_with_its_id(run):
    async def scenario(store):
        async with deploy_held_at_start(store) as (servicer, agent, deploying, stub):
            draining = asyncio.ensure_future(servicer.drain(0.5))
            await asyncio.sleep(0.1)
            # While it drains, a new call is refused as draining, with UNAVAILABLE.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListDeployments(deploy_pb.ListDeploymentsRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert refused.value.details().startswith("deployment service is draining: ")
            assert await draining  # every call ended within the drain's second wait
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await deploying
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        deployment_id = agent.started[0]
        assert re.fullmatch(
            f"the deployment service stopped before deployment {deployment_id} of m was "
            r"ready: it was rolled back \(its workers stopped, its memory released\); "
            "deploy again once the service is back",
            cut.value.details(),
        ), cut.value.details()
        assert agent.stopped == [deployment_id]
        assert await nothing_left(store)

    run(scenario)


def test_a_deploy_that_ends_within_the_drain_is_answered(run):
    async def scenario(store):
        async with deploy_held_at_start(store) as (servicer, agent, deploying, _):
            draining = asyncio.ensure_future(servicer.drain(30))
            await asyncio.sleep(0.1)
            assert not draining.done()
            agent.gate.set()
            assert (await deploying).deployment.state == READY
            assert await draining
        assert agent.stopped == []

    run(scenario)


def test_a_client_that_cancels_its_deploy_still_rolls_it_back(run):
    """The Deploy's own task: a client's cancel reaches it as before (no cut-off)."""

    async def scenario(store):
        async with deploy_held_at_start(store) as (servicer, agent, deploying, _):
            deploying.cancel()
            for _ in range(200):
                if agent.stopped:
                    break
                await asyncio.sleep(0.02)
            assert agent.stopped == agent.started
            assert await nothing_left(store)
            assert servicer.in_flight.count == 0

    run(scenario)
