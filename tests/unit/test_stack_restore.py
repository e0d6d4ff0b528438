"""What `iserve up` waits for among the deployments Redis kept (services.cli.stack): a
deployment serves again once every replica not given up answers, so a replica the
deployer gave up on no longer keeps `up` waiting its whole 300 s."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.api import deployment_service_pb2 as deploy_pb
from services.cli.stack import _replicas_out, _serving
from services.ports import free_port

READY = deploy_pb.DEPLOYMENT_STATE_READY
STARTING = deploy_pb.DEPLOYMENT_STATE_STARTING
FAILED = deploy_pb.DEPLOYMENT_STATE_FAILED


@pytest.fixture(scope="module")
def worker() -> str:
    """A gRPC server answering health checks SERVING, as a ready worker does."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    yield address
    server.stop(0)


def deployment(*replicas: tuple[int, str, str]) -> deploy_pb.Deployment:
    dep = deploy_pb.Deployment(deployment_id="m-1", state=READY)
    for state, address, reason in replicas:
        dep.replicas.add(
            index=len(dep.replicas), state=state, worker_address=address, state_reason=reason
        )
    return dep


def test_a_replica_given_up_is_not_waited_for_and_is_named(worker):
    gone = f"127.0.0.1:{free_port()}"  # nothing listens
    out = "gave up after 5 restart(s) in a row (at most 5); last error: no live devices"
    assert _serving(deployment((READY, worker, ""), (FAILED, "", out)))
    assert _replicas_out(deployment((READY, worker, ""), (FAILED, "", out))).startswith(
        " (replica 1 out: gave up after 5 restart(s)"
    )
    assert _replicas_out(deployment((READY, worker, ""))) == ""
    # Still waited for: a replica restarting, or one whose worker does not answer yet.
    assert not _serving(deployment((READY, worker, ""), (STARTING, "", "restart 1 in 1 s")))
    assert not _serving(deployment((READY, worker, ""), (READY, gone, "")))
    # Nothing serves: not restored.
    assert not _serving(deployment((FAILED, "", out)))
    starting = deployment((READY, worker, ""))
    starting.state = STARTING
    assert not _serving(starting)


def test_a_replica_waiting_for_a_node_that_is_gone_is_not_waited_for(worker):
    """`iserve up` waited its whole 300 s for a replica whose other host's agent was down,
    while the deployment served on its other replica."""
    from deploy_svc.healing import waiting_for_nodes
    from services.api import common_pb2 as common

    old = common.Placement(
        stages=[
            common.StagePlacement(devices=[common.DeviceRef(node_id="nodeb", device_id="cpu0")])
        ]
    )
    nodes = [
        common.NodeState(
            node_id="nodeb",
            alive=False,
            devices=[common.DeviceState(ref=old.stages[0].devices[0], hardware_type="cpu")],
        ),
        common.NodeState(
            node_id="node0",
            alive=True,
            devices=[
                common.DeviceState(
                    ref=common.DeviceRef(node_id="node0", device_id="cpu0"), hardware_type="cpu"
                )
            ],
        ),
    ]
    reason = waiting_for_nodes(old, nodes)
    assert reason.startswith("waiting for node(s) nodeb: stopped heartbeating")
    waiting = deployment((READY, worker, ""), (STARTING, "", reason))
    assert _serving(waiting)
    assert _replicas_out(waiting).startswith(" (replica 1 out: waiting for node(s) nodeb")
