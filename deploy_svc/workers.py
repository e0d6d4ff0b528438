"""A deployment's worker groups on the node agents: start one and wait until it is
ready, stop them, and release the memory they held.

A replica's group goes by ``services.ids.replica_group_id`` with the agents and in the
reservations. A group whose ranks span nodes meets at a rendezvous on rank 0's node: its
agent's host and a port drawn from ``RENDEZVOUS_PORTS`` for each launch (an agent whose
node runs every rank picks a free loopback port itself). Stopping is best effort: an agent that is gone or does not answer is logged
and skipped, and its memory is released all the same (the reconciler stops what such an
agent still runs once it is back).
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import grpc

from deploy_svc.agents import AgentClients, Reachability
from deploy_svc.explicit import checkpoint_for
from services import replicas
from services.api import agent_service_pb2 as agent_pb
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from services.drain import WORKER_STOP_MARGIN_S, worker_stop_s
from services.errors import FailedPrecondition, from_rpc_error
from services.ids import replica_group_id
from services.settings import Settings
from services.state.store import StateStore

log = logging.getLogger("iserve.deploy.workers")
# Where rank 0 of a group spread over nodes listens for the others (torch.distributed's
# TCP store): below Linux's ephemeral ports (32768-60999), so no outgoing connection holds
# one, beside torch's customary 29500. A port in use fails that launch with rank 0's
# "address already in use"; the next launch draws again.
RENDEZVOUS_PORTS = range(29500, 30500)


def rendezvous_for(replica: deploy_pb.Replica, addresses: dict[str, str]) -> str:
    """The rendezvous of ``replica``'s group: "" when one node runs every rank (its agent
    picks one), else rank 0's agent host and a drawn port."""
    nodes = replicas.nodes_of(replica.placement)
    if len(nodes) <= 1:
        return ""
    rank0_node = replica.placement.stages[0].devices[0].node_id
    host = addresses.get(rank0_node, "").rpartition(":")[0]
    if not host:
        raise FailedPrecondition(f"node {rank0_node} (rank 0) is not alive")
    return f"{host}:{secrets.choice(RENDEZVOUS_PORTS)}"


class WorkerGroups:
    def __init__(self, settings: Settings, store: StateStore, agents: AgentClients):
        self.settings = settings
        self.store = store
        self.agents = agents
        # Shared with the healer, the planner and the reconciler (which asks every agent).
        self.reach = Reachability()

    async def _agent_addresses(self) -> dict[str, str]:
        """Each node's agent address, "" for a node that is not alive (one listing)."""
        return {
            n.node_id: n.agent_address if n.alive else "" for n in await self.store.list_nodes()
        }

    @staticmethod
    def _address(addresses: dict[str, str], node_id: str) -> str:
        if node_id not in addresses:
            raise FailedPrecondition(f"node {node_id} is unknown")
        if not addresses[node_id]:
            raise FailedPrecondition(f"node {node_id} is not alive")
        return addresses[node_id]

    async def start(
        self,
        model: model_pb.Model,
        deployment: deploy_pb.Deployment,
        replica: deploy_pb.Replica,
        max_seq_len: int,
        ready_timeout_ms: int,
    ) -> str:
        """Start one replica's workers and wait until they are ready; returns the address
        of its rank 0."""
        timeout_ms = ready_timeout_ms or int(self.settings.ready_timeout_s * 1000)
        config = deployment.config
        group = replica_group_id(deployment.deployment_id, replica.index)
        by_node: dict[str, list[agent_pb.WorkerSpec]] = {}
        for stage in replica.placement.stages:
            for tensor_rank, ref in enumerate(stage.devices):
                by_node.setdefault(ref.node_id, []).append(
                    agent_pb.WorkerSpec(
                        rank=stage.stage * config.tensor_parallel + tensor_rank,
                        device_id=ref.device_id,
                        stage=stage.stage,
                        tensor_rank=tensor_rank,
                        first_layer=stage.first_layer,
                        layer_count=stage.layer_count,
                    )
                )
        addresses = await self._agent_addresses()
        rendezvous = rendezvous_for(replica, addresses)

        async def start_all() -> list[tuple[str, object]]:
            """(node, reply or error) for each node whose call ended on its own. The
            first failure cancels the calls still waiting (their agents stop what they
            started), so a node that cannot start its ranks fails the group at once
            rather than after the others' ready timeout (rank 0 waits that long for a
            peer that never comes); none is left running when this returns."""
            calls = {
                asyncio.ensure_future(
                    self.agents.stub(address).StartWorkers(
                        agent_pb.StartWorkersRequest(
                            request_id=deployment.request_id,
                            deployment_id=group,
                            checkpoint_path=checkpoint_for(model, config),
                            config=config,
                            workers=by_node[node_id],
                            max_seq_len=max_seq_len,
                            # Each node's choice (its ISERVE_ENGINE): TensorRT-LLM where
                            # it runs the whole group, else the PyTorch engine.
                            engine=agent_pb.ENGINE_KIND_UNSPECIFIED,
                            ready_timeout_ms=timeout_ms,
                            rendezvous_address=rendezvous,
                            expected_shape=model.shape,
                            node_id=node_id,
                        ),
                        timeout=timeout_ms / 1000 + 10,
                    )
                ): node_id
                for node_id, address in node_addresses.items()
            }
            try:
                done, _ = await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for call in calls:
                    call.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
            return [
                (calls[call], call.exception() or call.result()) for call in calls if call in done
            ]

        node_addresses = {node_id: self._address(addresses, node_id) for node_id in by_node}
        replies = await start_all()
        if any(
            isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.ALREADY_EXISTS
            for _, r in replies
        ):
            # Workers of this group outlived their replica where its agent could not be
            # told to stop them (it was not answering): stop them, then start once more.
            log.warning("stopping stale workers of %s before starting it again", group)
            await self.stop_on(sorted(by_node), group)
            replies = await start_all()
        for node, reply in replies:
            if isinstance(reply, grpc.RpcError) and reply.code() == grpc.StatusCode.UNAVAILABLE:
                self.reach.unreachable(node_addresses[node], reply.details() or "")
            elif not isinstance(reply, BaseException):
                self.reach.answered(node_addresses[node])
        node_id, failed = next(
            ((n, r) for n, r in replies if isinstance(r, BaseException)), ("", None)
        )
        if isinstance(failed, grpc.RpcError):
            raise from_rpc_error(
                failed, f"starting workers of {group} on node {node_id}"
            ) from failed
        if failed is not None:
            raise failed
        return next(w.address for _, reply in replies for w in reply.workers if w.rank == 0)

    async def teardown(self, deployment: deploy_pb.Deployment) -> None:
        """Stop every replica's workers on every node (best effort) and release its
        memory."""
        for replica in replicas.replicas_of(deployment):
            await self.teardown_replica(deployment.deployment_id, replica)

    async def teardown_replica(
        self, deployment_id: str, replica: deploy_pb.Replica, *, lost_rank: bool = False
    ) -> None:
        """Stop the replica's workers and release its memory; ``lost_rank``: a node of
        its group is dead, so the ranks left are stopped without a drain."""
        group = replica_group_id(deployment_id, replica.index)
        await self.stop_on(replicas.nodes_of(replica.placement), group, lost_rank=lost_rank)
        await self.store.release(group)

    async def stop_on(
        self, node_ids: list[str], deployment_id: str, *, lost_rank: bool = False
    ) -> None:
        """Ask the nodes' agents to stop a deployment's workers (best effort)."""
        addresses = await self._agent_addresses()
        # Side by side: a node whose workers drain (or whose agent does not answer) must
        # not hold up the others'.
        await asyncio.gather(
            *(self._stop_one(addresses, node_id, deployment_id, lost_rank) for node_id in node_ids)
        )

    async def _stop_one(
        self, addresses: dict[str, str], node_id: str, deployment_id: str, lost_rank: bool = False
    ) -> None:
        try:
            stub = self.agents.stub(self._address(addresses, node_id))
            reply = await stub.StopWorkers(
                agent_pb.StopWorkersRequest(deployment_id=deployment_id, lost_rank=lost_rank),
                # The agent answers once the workers exited (their streams drained), so
                # their memory is released only then.
                timeout=worker_stop_s(self.settings.drain_timeout_s) + WORKER_STOP_MARGIN_S,
            )
        except (grpc.RpcError, FailedPrecondition) as exc:
            log.warning("could not stop workers of %s on %s: %s", deployment_id, node_id, exc)
            return
        # A worker that had died before the stop: its cause (a signal, the OOM killer, its
        # log's tail), which a death the scheduler reported first ("worker unreachable")
        # does not give.
        for worker in reply.workers:
            if worker.state == agent_pb.WORKER_STATE_FAILED and worker.reason:
                log.warning(
                    "workers of %s on %s: rank %d had exited: %s",
                    deployment_id, node_id, worker.rank, worker.reason,
                )  # fmt: skip
