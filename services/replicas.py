"""A deployment's replicas in its record: which serve, and taking one out.

Replica ``i`` runs its workers and holds its memory under
``services.ids.replica_group_id(deployment_id, i)``. The record's own ``placement`` and
``worker_address`` are those of the first replica still serving, so a reader that knows
nothing of replicas still finds a serving worker. Pure: no gRPC, no Redis.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.errors import InvalidArgument

STARTING = deploy_pb.DEPLOYMENT_STATE_STARTING
READY = deploy_pb.DEPLOYMENT_STATE_READY
FAILED = deploy_pb.DEPLOYMENT_STATE_FAILED
MAX_REPLICAS = 16
# How the reason of a replica waiting for a node that is gone begins (deploy_svc.healing
# writes it): it holds no device and starts again once the node is back.
WAITING_FOR_NODE = "waiting for "


def stopped_nodes(nodes: Iterable[common.NodeState]) -> set[str]:
    """The ids of ``nodes`` whose agents stopped cleanly (SIGTERM) and have not come
    back: a planned stop, said as such, not a lost node."""
    return {n.node_id for n in nodes if not n.alive and n.stopped_at_unix_ms}


def waits_for_a_node(replica: deploy_pb.Replica) -> bool:
    """Whether ``replica`` waits, not started, for a node that is gone to come back."""
    return replica.state == STARTING and replica.state_reason.startswith(WAITING_FOR_NODE)


def reason_summary(reason: str) -> str:
    """The first line of a state reason: a worker's failure carries its log's last lines
    after it, which go neither to clients (they are the server's logs) nor into one-line
    listings; ``iserve deployments --json`` (GetDeployment) keeps the whole reason."""
    first, _, rest = reason.strip().partition("\n")
    return f"{first.rstrip(':').rstrip()} (log lines in the full reason)" if rest.strip() else first


def check_count(count: int) -> None:
    """InvalidArgument for a requested replica count above MAX_REPLICAS (0 means 1)."""
    if count > MAX_REPLICAS:
        raise InvalidArgument(f"replicas must be at most {MAX_REPLICAS}, got {count}")


def count_of(requested: int) -> int:
    """The replicas a request asks for: its ``replicas`` field, where 0 means 1."""
    return max(1, requested)


def replicas_of(deployment: deploy_pb.Deployment) -> list[deploy_pb.Replica]:
    """Every replica; a record written before replicas existed is one replica."""
    if deployment.replicas:
        return list(deployment.replicas)
    return [
        deploy_pb.Replica(
            index=0,
            placement=deployment.placement,
            worker_address=deployment.worker_address,
            state=deployment.state,
            state_reason=deployment.state_reason,
        )
    ]


def serving(deployment: deploy_pb.Deployment) -> list[deploy_pb.Replica]:
    """The replicas that serve requests (all of them while the deployment is READY, less
    those taken out)."""
    if deployment.state != READY:
        return []
    return [r for r in replicas_of(deployment) if r.state == READY]


def nodes_of(placement: common.Placement) -> list[str]:
    """The nodes a placement uses, sorted."""
    return sorted({ref.node_id for stage in placement.stages for ref in stage.devices})


def take_out(deployment: deploy_pb.Deployment, index: int, reason: str) -> bool:
    """Mark replica ``index`` FAILED with ``reason`` in the record and point the record's
    placement and worker address at the first replica still serving. Returns False (and
    changes nothing) when no other replica serves: then the deployment itself fails."""
    others = [r for r in serving(deployment) if r.index != index]
    if not others or not deployment.replicas:
        return False
    for replica in deployment.replicas:
        if replica.index == index:
            replica.state = FAILED
            replica.state_reason = reason
            replica.worker_address = ""  # its workers are stopped
    deployment.placement.CopyFrom(others[0].placement)
    deployment.worker_address = others[0].worker_address
    return True


def _point_at_first_serving(deployment: deploy_pb.Deployment) -> bool:
    """Point the record's placement and worker address at the first replica serving;
    False when none serves."""
    first = next((r for r in deployment.replicas if r.state == READY), None)
    if first is None:
        return False
    deployment.placement.CopyFrom(first.placement)
    deployment.worker_address = first.worker_address
    return True


def is_restarting(deployment: deploy_pb.Deployment) -> bool:
    """Whether the deployment serves nowhere because a replica is being restarted (not
    being deployed): STARTING with a reason, which only :func:`restarting` gives (a
    Deploy in progress is STARTING with none)."""
    return deployment.state == STARTING and bool(deployment.state_reason)


def restarting(deployment: deploy_pb.Deployment, index: int, reason: str) -> None:
    """Mark replica ``index`` STARTING (its workers gone, to be started again) with
    ``reason``. While another replica serves the deployment stays READY on it; else the
    deployment is STARTING with ``reason`` too (never READY without a worker)."""
    if not deployment.replicas:
        deployment.replicas.extend(replicas_of(deployment))
    for replica in deployment.replicas:
        if replica.index == index:
            replica.state = STARTING
            replica.state_reason = reason
            replica.worker_address = ""
    if deployment.state == READY and _point_at_first_serving(deployment):
        return
    deployment.state = STARTING
    deployment.state_reason = reason
    deployment.worker_address = ""


def back_in(
    deployment: deploy_pb.Deployment,
    index: int,
    placement: common.Placement,
    worker_address: str,
    note: str,
) -> None:
    """Replica ``index`` serves again on ``placement`` at ``worker_address``; the
    deployment is READY (``note`` its reason when it was not serving before)."""
    for replica in deployment.replicas:
        if replica.index == index:
            replica.placement.CopyFrom(placement)
            replica.worker_address = worker_address
            replica.state = READY
            replica.state_reason = note
    if deployment.state != READY:
        deployment.state = READY
        deployment.state_reason = note
    _point_at_first_serving(deployment)


def avoiding(deployment: deploy_pb.Deployment, addresses: set[str]) -> deploy_pb.Deployment:
    """``deployment`` less the serving replicas whose worker is at one of ``addresses``
    (a copy; the record itself is left alone), or ``deployment`` as it is when that
    would leave no replica serving."""
    if not addresses:
        return deployment
    serving_now = serving(deployment)
    gone = [r.index for r in serving_now if r.worker_address in addresses]
    if not gone or len(gone) == len(serving_now):
        return deployment
    copy = deploy_pb.Deployment()
    copy.CopyFrom(deployment)
    for index in gone:
        take_out(copy, index, "its worker is unreachable")
    return copy


def fail_all(deployment: deploy_pb.Deployment, reason: str) -> None:
    """Mark every replica still serving FAILED with ``reason`` (the deployment fails),
    and the record's worker address, "the first replica still serving", empty: a FAILED
    deployment showed its dead worker's address (a probe)."""
    for replica in deployment.replicas:
        if replica.state != FAILED:
            replica.state = FAILED
            replica.state_reason = reason
            replica.worker_address = ""
    deployment.worker_address = ""
