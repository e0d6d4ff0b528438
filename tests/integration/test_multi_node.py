"""A pipeline whose stages sit on two nodes: two agents (node0 and node1, one device
each, on this host over loopback) register in the same Redis; a pp = 2 deployment must
then span both, its ranks meet at the rendezvous the deployer gives them on rank 0's
node, and it generates what one process generates. When one node cannot start its
ranks, the deploy fails at once with that node's reason, and nothing is left starting
on the other."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from services.api import agent_service_pb2 as agent_pb
from services.api import (
    agent_service_pb2_grpc,
    deployment_service_pb2_grpc,
    inference_service_pb2_grpc,
    model_service_pb2_grpc,
)
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from services.api import model_service_pb2 as model_pb
from services.cli import stack as launcher
from services.health import wait_serving
from services.models.checkpoint import create_checkpoint
from services.ports import free_port
from tests.integration.helpers import TINY, rid, wait_for

MODEL = "two-node-llama"
# Only on node0's models root: node1 cannot start its ranks.
NODE0_ONLY = "node0-only-llama"
READY_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Iterator:
    root = tmp_path_factory.mktemp("iserve-two-nodes")
    env = {
        "ISERVE_DEVICES": "1",
        "ISERVE_DEVICE_MEMORY_GIB": "2",
        "ISERVE_READY_TIMEOUT_S": str(READY_TIMEOUT_S),
    }
    with launcher.temporary_stack(env, state_dir=root / "node0") as settings:
        agent_address = f"127.0.0.1:{free_port()}"
        node1_models(settings).mkdir()
        second = subprocess.Popen(
            [sys.executable, "-m", "monitor_agent"],
            env={
                **os.environ,
                "REDIS_URL": settings.redis_url,
                "ISERVE_STATE_DIR": str(root / "node1"),
                # Its own models root (a node without the shared volume), filled by the
                # tests.
                "ISERVE_MODELS_ROOT": str(node1_models(settings)),
                "ISERVE_NODE_ID": "node1",
                "ISERVE_AGENT_ADDR": agent_address,
                "ISERVE_AGENT_METRICS_ADDR": f"127.0.0.1:{free_port()}",
            },
            stdout=subprocess.DEVNULL,
            stderr=open(root / "node1-agent.log", "w"),  # noqa: SIM115 - closed with the process
        )
        try:
            assert wait_serving(agent_address, time.monotonic() + 60, second), (
                root / "node1-agent.log"
            ).read_text()[-2000:]
            deployer = deployment_service_pb2_grpc.DeploymentServiceStub(
                grpc.insecure_channel(settings.address("deploy"))
            )

            def both_alive() -> bool:
                state = deployer.GetClusterState(deploy_pb.GetClusterStateRequest())
                return sorted(n.node_id for n in state.nodes if n.alive) == ["node0", "node1"]

            assert wait_for(both_alive, timeout=30)
            yield settings
        finally:
            second.terminate()
            try:
                second.wait(timeout=30)
            except subprocess.TimeoutExpired:
                second.kill()


def node1_models(settings):
    return settings.models_root.parent / "node1-models"


def _register(settings, model_id: str) -> None:
    with grpc.insecure_channel(settings.address("model")) as ch:
        model_service_pb2_grpc.ModelServiceStub(ch).RegisterModel(
            model_pb.RegisterModelRequest(
                model_id=model_id, checkpoint_path=model_id, skip_profiling=True
            )
        )


def _greedy(settings, deployment_id: str) -> list[int]:
    with grpc.insecure_channel(settings.address("scheduler")) as ch:
        stub = inference_service_pb2_grpc.InferenceServiceStub(ch)
        ids = []
        for reply in stub.Generate(
            infer_pb.GenerateRequest(
                request_id=rid(),
                deployment_id=deployment_id,
                prompt="The river runs past the old mill",
                max_tokens=8,
                sampling=common.SamplingParams(ignore_eos=True),
            ),
            timeout=120,
        ):
            if reply.HasField("delta"):
                ids.extend(reply.delta.token_ids)
        return ids


def test_a_pipeline_spans_two_nodes_and_generates_what_one_process_does(two_nodes):
    settings = two_nodes
    create_checkpoint(settings.models_root / MODEL, **{**TINY, "num_layers": 4}, overwrite=True)
    shutil.copytree(settings.models_root / MODEL, node1_models(settings) / MODEL)
    _register(settings, MODEL)
    deployer = deployment_service_pb2_grpc.DeploymentServiceStub(
        grpc.insecure_channel(settings.address("deploy"))
    )

    def deploy(tp: int, pp: int) -> deploy_pb.Deployment:
        return deployer.Deploy(
            deploy_pb.DeployRequest(
                request_id=rid(),
                model_id=MODEL,
                config=common.DeploymentConfig(tensor_parallel=tp, pipeline_parallel=pp),
            ),
            timeout=240,
        ).deployment

    spread = deploy(1, 2)
    nodes = [stage.devices[0].node_id for stage in spread.placement.stages]
    assert sorted(nodes) == ["node0", "node1"], spread.placement
    across = _greedy(settings, spread.deployment_id)
    deployer.RemoveDeployment(deploy_pb.RemoveDeploymentRequest(deployment_id=spread.deployment_id))

    single = deploy(1, 1)
    alone = _greedy(settings, single.deployment_id)
    deployer.RemoveDeployment(deploy_pb.RemoveDeploymentRequest(deployment_id=single.deployment_id))
    assert len(across) == 8 and across == alone


def test_a_node_that_cannot_start_its_ranks_fails_the_deploy_at_once(two_nodes):
    """node1 has no copy of the checkpoint: its agent refuses at once, while rank 0 on
    node0 would wait at the rendezvous for the whole ready timeout. The deploy must fail
    with node1's reason without that wait, and rank 0 must be stopped, its memory free."""
    settings = two_nodes
    create_checkpoint(
        settings.models_root / NODE0_ONLY, **{**TINY, "num_layers": 4}, overwrite=True
    )
    _register(settings, NODE0_ONLY)
    deployer = deployment_service_pb2_grpc.DeploymentServiceStub(
        grpc.insecure_channel(settings.address("deploy"))
    )
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as failed:
        deployer.Deploy(
            deploy_pb.DeployRequest(
                request_id=rid(),
                model_id=NODE0_ONLY,
                config=common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=2),
            ),
            # Well under the ready timeout: waiting it out would end in DEADLINE_EXCEEDED.
            timeout=READY_TIMEOUT_S * 3 / 4,
        )
    took = time.monotonic() - started
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value.details()
    details = failed.value.details()
    assert "on node node1" in details and "does not exist" in details, details
    assert took < READY_TIMEOUT_S / 2, took

    deployments = deployer.ListDeployments(deploy_pb.ListDeploymentsRequest()).deployments
    assert [d for d in deployments if d.model_id == NODE0_ONLY] == []
    with grpc.insecure_channel(settings.address("agent")) as ch:
        agent = agent_service_pb2_grpc.AgentServiceStub(ch)
        workers = agent.ListWorkers(agent_pb.ListWorkersRequest()).workers
    assert [w for w in workers if w.state != agent_pb.WORKER_STATE_STOPPED] == [], workers

    def nothing_reserved() -> bool:
        state = deployer.GetClusterState(deploy_pb.GetClusterStateRequest())
        return all(d.reserved_bytes == 0 for n in state.nodes for d in n.devices)

    assert wait_for(nothing_reserved, timeout=30)


def _agent(settings, root, node_id: str, name: str) -> tuple[subprocess.Popen, str]:
    """An agent process for ``node_id`` in the two-node cluster's Redis, and its address."""
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "monitor_agent"],
        env={
            **os.environ,
            "REDIS_URL": settings.redis_url,
            "ISERVE_STATE_DIR": str(root / name),
            "ISERVE_MODELS_ROOT": str(node1_models(settings)),
            "ISERVE_NODE_ID": node_id,
            "ISERVE_AGENT_ADDR": address,
            "ISERVE_AGENT_METRICS_ADDR": f"127.0.0.1:{free_port()}",
            "ISERVE_HEARTBEAT_TTL_S": "1",
            "ISERVE_WORKER_POOL": "0",
        },
        stdout=subprocess.DEVNULL,
        stderr=open(root / f"{name}.log", "w"),  # noqa: SIM115 - closed with the process
    )
    assert wait_serving(address, time.monotonic() + 60, process), (
        root / f"{name}.log"
    ).read_text()[-2000:]
    return process, address


def test_an_agent_replaced_while_frozen_exits_instead_of_sharing_its_node_id(two_nodes, tmp_path):
    """A SIGSTOPped agent did not answer the start-up check, so a new agent took its node
    id; resumed, the old one registered the id in turn with the new one, and a
    deployment's rank ran twice on that node (a probe). It now stops and exits, and the
    node stays the new agent's."""
    import signal

    from services.state.store import StateStore

    settings = two_nodes
    old, _ = _agent(settings, tmp_path, "node9", "old")
    new = None
    try:
        old.send_signal(signal.SIGSTOP)
        time.sleep(2.5)  # past its 1 s heartbeat
        new, new_address = _agent(settings, tmp_path, "node9", "new")
        old.send_signal(signal.SIGCONT)
        assert old.wait(timeout=30) is not None  # it exits of itself
        said = (tmp_path / "old.log").read_text()
        assert f"node id 'node9' was taken over by the agent at {new_address}" in said, said
        assert new.poll() is None

        async def holder() -> str:
            store = StateStore.from_url(settings.redis_url)
            try:
                node = await store.get_node("node9")
                return node.agent_address if node is not None and node.alive else ""
            finally:
                await store.close()

        import asyncio

        time.sleep(1.5)  # a registration of the new agent after the old one left
        assert asyncio.run(holder()) == new_address
    finally:
        for process in (old, new):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
                process.wait(timeout=30)
