"""Self-healing deployments: a failed replica is taken out and started again.

The decisions (how long to wait, when to give up, which devices) are
``deploy_svc.healing``'s; this module keeps the restart record in Redis, takes the
replica out (workers stopped, memory released, the record STARTING while nothing else
serves), waits the backoff, reserves and launches it again, and records the outcome.
A restart in progress survives a restart of the deployer: the record says STARTING and
the restart record exists, and :meth:`Healer.resume` picks it up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from deploy_svc import healing
from deploy_svc.workers import WorkerGroups
from services import replicas
from services.aio import cancel_and_wait
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.errors import CHECKPOINT_UNUSABLE
from services.ids import replica_group_id
from services.state.store import ReservationError, StateStore
from services.token_limits import sequence_length

log = logging.getLogger("iserve.deploy.healer")
# How often a restart waiting for a live node looks again.
NODE_WAIT_POLL_S = 2.0


class NoLiveNode(str):
    """Why a restart cannot start for want of any live node with devices like its own:
    tried again every NODE_WAIT_POLL_S, spending no restart budget (a node agent down
    for half a minute made every deployment on it FAILED for good)."""


class Refused(str):
    """Why a restart was refused for good: every place tried refused it for its
    checkpoint (services.errors.CHECKPOINT_UNUSABLE), which no retry changes (a model
    whose weights were deleted while the stack was down spent the whole restart budget,
    half a minute, before it was FAILED)."""


GONE = (deploy_pb.DEPLOYMENT_STATE_FAILED, deploy_pb.DEPLOYMENT_STATE_REMOVING)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _need(where: common.Placement) -> dict[tuple[str, str], int]:
    return {
        (ref.node_id, ref.device_id): stage.reserved_bytes[i]
        for stage in where.stages
        for i, ref in enumerate(stage.devices)
    }


class Healer:
    """Restarts failed replicas for the deployment controller, sharing its per-deployment
    ``lock``, its one way to fail a deployment (``mark_failed``) and its ``reconciled``
    event (set once start-up reconciliation has run)."""

    def __init__(
        self,
        store: StateStore,
        workers: WorkerGroups,
        lock: Callable[[str], asyncio.Lock],
        mark_failed: Callable[[deploy_pb.Deployment, str], Awaitable[None]],
        reconciled: asyncio.Event,
        policy: healing.RestartPolicy,
    ):
        self.store = store
        self.workers = workers
        self.lock = lock
        self.mark_failed = mark_failed
        self.reconciled = reconciled
        self.policy = policy
        self._tasks: set[asyncio.Task] = set()
        # The restart task scheduled for each (deployment id, replica index).
        self._scheduled: dict[tuple[str, int], asyncio.Task] = {}

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks))

    async def record_of(self, deployment_id: str) -> healing.RestartRecord | None:
        raw = await self.store.get_restarts(deployment_id)
        return None if raw is None else healing.RestartRecord.from_json(raw)

    async def replica_failed(
        self,
        deployment: deploy_pb.Deployment,
        index: int,
        error: str,
        *,
        planned: bool = False,
        final: bool = False,
        lost_rank: bool = False,
        unresponsive: bool = False,
    ) -> None:
        """Replica ``index`` of ``deployment`` (the caller holds its lock) failed with
        ``error``: schedule its restart, or when the budget is spent take it out for good
        (the deployment FAILED when no other replica serves). ``planned``: its workers
        were stopped on purpose; it starts again at once, its restart record unchanged
        (kept, so a restart of the deployer resumes it). ``final``: no restart could
        succeed (see Refused); it is taken out at once. ``lost_rank``: a node of its
        group is dead, so its ranks elsewhere are stopped without a drain, and it starts
        again at once spending no budget (``healing.after_node_loss``). ``unresponsive``:
        its worker answers nothing (hung), so its ranks are stopped without a drain too,
        and the restart counts as any failure's: the backoff the note states starts
        about when the note is written, not after the drain timeout."""
        deployment_id = deployment.deployment_id
        no_drain = lost_rank or unresponsive
        record = await self.record_of(deployment_id)
        if planned:
            step = healing.restore(record, error)
        elif final:
            step = healing.refused(record, error, _now_ms())
        elif lost_rank:
            step = healing.after_node_loss(record, error)
        else:
            step = healing.after_failure(self.policy, record, error, _now_ms())
        await self.store.put_restarts(deployment_id, step.record.to_json())
        replica = next(r for r in replicas.replicas_of(deployment) if r.index == index)
        if isinstance(step, healing.GiveUp):
            if not replicas.take_out(deployment, index, step.reason):
                await self.mark_failed(deployment, step.reason)
                return
            await self.store.put_deployment(deployment)
            await self.workers.teardown_replica(deployment_id, replica, lost_rank=no_drain)
            await self.store.publish_event(
                "replica_failed", deployment_id=deployment_id, replica=index, reason=step.reason
            )
            log.warning("deployment %s: replica %d out: %s", deployment_id, index, step.reason)
            return
        replicas.restarting(deployment, index, step.note)
        await self.store.put_deployment(deployment)
        await self.workers.teardown_replica(deployment_id, replica, lost_rank=no_drain)
        await self.store.publish_event(
            "replica_restarting",
            deployment_id=deployment_id,
            replica=index,
            restart=step.record.in_a_row,
            delay_s=step.delay_s,
            reason=error,
        )
        log.warning("deployment %s replica %d: %s", deployment_id, index, step.note)
        self.schedule(deployment_id, index, step.delay_s)

    def schedule(self, deployment_id: str, index: int, delay_s: float) -> None:
        """Restart replica ``index`` in ``delay_s`` seconds, unless a restart of it is
        already scheduled (by another task than the one asking): after a stack restart
        the planned restore and the reconciler's resume each queued one, and both chains
        spent the one budget, a failing replica giving up three times too fast (a probe)."""
        key = (deployment_id, index)
        pending = self._scheduled.get(key)
        if pending is not None and not pending.done() and pending is not asyncio.current_task():
            log.info("deployment %s replica %d: its restart is already scheduled", *key)
            return
        task = asyncio.get_running_loop().create_task(self._restart(deployment_id, index, delay_s))
        self._scheduled[key] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda done: self._forget_scheduled(key, done))

    def _forget_scheduled(self, key: tuple[str, int], task: asyncio.Task) -> None:
        if self._scheduled.get(key) is task:
            del self._scheduled[key]

    async def resume(self, deployments: list[deploy_pb.Deployment]) -> list[str]:
        """After a deployer restart: schedule again the restarts that were in progress
        (replicas STARTING in a deployment that has a restart record); returns what it
        did, one line each."""
        actions = []
        for deployment in deployments:
            if deployment.state in GONE or await self.record_of(deployment.deployment_id) is None:
                continue
            for replica in deployment.replicas:
                if replica.state == replicas.STARTING:
                    self.schedule(deployment.deployment_id, replica.index, 0.0)
                    actions.append(
                        f"resumed restarting {replica_group_id(deployment.deployment_id, replica.index)}"
                    )
        return actions

    async def _restart(self, deployment_id: str, index: int, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        # Never before start-up reconciliation, which would take the new workers and
        # reservation for orphans.
        await self.reconciled.wait()
        try:
            error = await self._relaunch(deployment_id, index)
        except Exception as exc:  # noqa: BLE001 - e.g. Redis down: counts as a failure
            error = f"restart failed: {exc}"
        if error is None:
            return
        if isinstance(error, NoLiveNode):
            # Not a failure of the replica: it waits for its node, spending no budget.
            await self._note_waiting(deployment_id, index, error)
            self.schedule(deployment_id, index, NODE_WAIT_POLL_S)
            return
        async with self.lock(deployment_id):
            deployment = await self.store.get_deployment(deployment_id)
            if not self._still_restarting(deployment, index):
                return
            await self.replica_failed(deployment, index, error, final=isinstance(error, Refused))

    async def _note_waiting(self, deployment_id: str, index: int, why: str) -> None:
        """Say in the replica's record (once), and the deployment's when it is not
        serving, that its restart waits for a node."""
        async with self.lock(deployment_id):
            deployment = await self.store.get_deployment(deployment_id)
            if not self._still_restarting(deployment, index):
                return
            replica = next(r for r in deployment.replicas if r.index == index)
            if replica.state_reason != why:
                log.warning("deployment %s replica %d: %s", deployment_id, index, why)
                # The deployment says so too while no other replica serves it.
                replicas.restarting(deployment, index, why)
                await self.store.put_deployment(deployment)

    @staticmethod
    def _still_restarting(deployment: deploy_pb.Deployment | None, index: int) -> bool:
        if deployment is None or deployment.state in GONE:
            return False
        return any(r.index == index and r.state == replicas.STARTING for r in deployment.replicas)

    async def _relaunch(self, deployment_id: str, index: int) -> str | None:
        """Place, reserve and start replica ``index`` again; None when it serves (or
        needs no restart any more), else why it could not."""
        async with self.lock(deployment_id):
            deployment = await self.store.get_deployment(deployment_id)
            if not self._still_restarting(deployment, index):
                return None
            replica = next(r for r in deployment.replicas if r.index == index)
            model = await self.store.get_model(deployment.model_id)
            if model is None:
                return f"model {deployment.model_id} is no longer registered"
            max_seq_len = sequence_length(deployment.max_input_tokens, deployment.max_output_tokens)
            others = healing.held_placements(deployment, index)
            listed = await self.store.list_nodes()
            # A node whose agent the last call could not reach counts as not alive: it
            # failed every restart placed on it, each spending the budget.
            unanswered = self.workers.reach.unanswered(listed)
            nodes = self.workers.reach.usable(listed)
            tries = healing.placements_to_try(
                model, deployment.config, replica.placement, nodes, others, max_seq_len
            )
            if not tries:
                waiting = healing.waiting_for_nodes(replica.placement, nodes, unanswered)
                if waiting:
                    return NoLiveNode(waiting)
                gone = healing.gone_devices(replica.placement, nodes)
                if gone:
                    return (
                        f"its device(s) {', '.join(gone)} are gone and no other live device "
                        "has room to start it again"
                    )
                return "no live devices with room to start it again"
            group = replica_group_id(deployment_id, index)
            refused, failed, for_good = [], [], True
            # Best first; a start that fails (its old devices broken, say) tries the next
            # place in the same attempt rather than the same place at every restart.
            for chosen in tries:
                try:
                    await self.store.reserve(group, _need(chosen))
                except ReservationError as exc:
                    refused.append(str(exc))
                    continue
                replica.placement.CopyFrom(chosen)
                try:
                    address = await self.workers.start(model, deployment, replica, max_seq_len, 0)
                except Exception as exc:  # noqa: BLE001 - any failed launch is retried
                    await self.workers.teardown_replica(deployment_id, replica)
                    failed.append(f"on {healing.where(chosen)}: {exc}")
                    for_good &= getattr(exc, "reason", "") == CHECKPOINT_UNUSABLE
                    continue
                break
            else:
                if failed and for_good and not refused:
                    return Refused("restart refused " + "; ".join(failed))
                if failed:
                    return "restart failed " + "; ".join(failed)
                # Every place it fitted a moment ago was taken since, by another replica
                # of the same loss moved at once (a tester: the second of a dead node's two
                # replicas spent its budget so). While a node it ran on may come back, that
                # is the wait for room it would be had the other reserved first.
                waiting = healing.waiting_for_nodes(replica.placement, nodes, unanswered)
                if waiting:
                    return NoLiveNode(waiting)
                return "could not reserve memory to start it again: " + "; ".join(refused)
            record = await self.record_of(deployment_id) or healing.RestartRecord()
            note = healing.served_again_note(record, replica.state_reason)
            replicas.back_in(deployment, index, chosen, address, note)
            await self.store.put_deployment(deployment)
            await self.store.publish_event(
                "replica_restarted", deployment_id=deployment_id, replica=index, address=address
            )
            log.info("deployment %s replica %d serves again at %s", deployment_id, index, address)
            return None
