"""Keeps deployment records true to the workers.

On start, :meth:`Reconciler.reconcile_on_start` makes Redis and the agents agree after
a restart of the deployer. Then, for as long as it runs, a worker that died, a worker
the scheduler cannot reach, or a node whose agent stopped heartbeating takes its replica
out (workers stopped, memory released) to be restarted with backoff, elsewhere when its
node is gone (``deploy_svc.healer``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from deploy_svc.agents import AgentClients
from deploy_svc.controller import DeploymentController
from services import replicas
from services.aio import cancel_and_wait
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.grpc_server import channel
from services.health import serving_status
from services.ids import replica_group_id, split_group_id
from services.state import keys
from services.state.store import StateStore, StateStoreUnavailable

log = logging.getLogger("iserve.deploy.reconciler")
HEALTH_TIMEOUT_S = 1.0


# Why a deployment left STARTING with no Deploy behind it is failed (finish_cut_off).
RESTARTED_WHILE_STARTING = "the deployer restarted while the deployment was starting"
CUT_OFF = (
    "the Deploy that started it ended before it was ready and could not undo it (the state "
    "store was unreachable meanwhile); its workers are stopped and its memory released"
)


async def worker_status(address: str) -> str:
    """The worker's health status: SERVING, NOT_SERVING (draining) or UNREACHABLE (gone,
    or hung: no answer within HEALTH_TIMEOUT_S)."""
    async with channel(address) as ch:
        return await serving_status(ch, HEALTH_TIMEOUT_S)


# Reservations and workers of profiling jobs (fingerprint_svc.profiler) are not ours.
PROFILING_OWNER_PREFIX = "profile-"
# How check_workers' action list begins a replica restored after a stop on purpose.
RESTORING = "restoring"
LIST_TIMEOUT_S = 15.0
# How long the check that a lost worker's nodes live waits for their agents.
NODE_CHECK_TIMEOUT_S = 2.0
# How often the agents are asked which workers they run (``Reconciler.check_workers``).
WORKER_CHECK_INTERVAL_S = 3.0


@dataclass(frozen=True)
class _NodeWorker:
    node_id: str
    rank: int


def _rank_count(placement: common.Placement) -> int:
    return sum(len(stage.devices) for stage in placement.stages)


def _with_reason(said: str, event: dict) -> str:
    """``said``, then the event's reason after a colon when it gives one."""
    why = str(event.get("reason") or "").strip()
    return f"{said}: {why}" if why else said


def _stopped_heartbeating(nodes: Iterable[str], stopped: Iterable[str] = ()) -> str:
    """Why a replica on the dead ``nodes`` is lost, in the words the restart record
    keeps; those among ``stopped`` (their agents stopped cleanly, a planned stop) said
    to be."""
    planned = sorted(set(nodes) & set(stopped))
    lapsed = sorted(set(nodes) - set(planned))
    parts = [f"node agent(s) {', '.join(lapsed)} stopped heartbeating"] if lapsed else []
    if planned:
        parts.append(f"node agent(s) {', '.join(planned)} stopped on purpose")
    return "; ".join(parts)


def _restarted(nodes: Iterable[str]) -> str:
    """Why a replica on ``nodes`` is lost when their agents answer but know nothing of its
    workers: an agent keeps the record of a worker that died under it (FAILED), so one
    with none started since, and the workers stopped with the agent before it."""
    return (
        f"node agent(s) {', '.join(sorted(nodes))} restarted since its workers started "
        "(they stopped with the agent)"
    )


class Reconciler:
    def __init__(self, controller: DeploymentController, store: StateStore, agents: AgentClients):
        self.controller = controller
        self.store = store
        self.agents = agents
        # Node id -> the status its agent last failed with, while it does not answer.
        self._unanswered_logged: dict[str, grpc.StatusCode] = {}
        # Replicas whose workers were stopped on purpose (the deployer stopped cleanly,
        # then the agents stopped their workers): not yet seen by an answering agent.
        self._stopped_on_purpose: set[str] = set()
        # (group, node) of the workers no deployment held at the last workers check.
        self._unheld_seen: set[tuple[str, str]] = set()
        # Groups with worker records and no deployment at the last workers check.
        self._orphaned_seen: set[str] = set()

    async def reconcile_on_start(self) -> list[str]:
        """Make Redis and the agents agree after a (re)start of this service; returns what
        it did, one line per action.

        READY deployments whose workers all still run are kept; a replica missing a
        worker is taken out and restarted (``deploy_svc.healer``), as after a stop and
        start of the whole stack. STARTING ones restarting a replica go on; other STARTING
        ones were cut off by the restart: failed. REMOVING ones are finished. Reservations with no
        deployment behind them (and not a profiling job's) are released, and workers of
        deployments Redis does not know are stopped.
        """
        actions: list[str] = []
        deployments = await self.store.list_deployments()
        actions += [
            f"moved the Deploy request id of {moved} to its owner's keys"
            for moved in await self.store.scope_deploy_requests(deployments)
        ]
        # After a clean stop (iserve down: this service first, then the agents stop their
        # workers) a missing worker is a restore, not a failure: no restart budget spent,
        # whether its agent answers now or only once it has started.
        if await self.store.take_deployer_stopped() is not None:
            self._stopped_on_purpose = {
                replica_group_id(d.deployment_id, r.index)
                for d in deployments
                for r in replicas.serving(d)
            }
        running, answered, known = await self._running_workers()
        actions += await self._fail_missing(
            deployments, running, answered, known, "after a deployer restart"
        )
        # Restarting a replica: resumed below.
        actions += await self.finish_cut_off(deployments, RESTARTED_WHILE_STARTING)
        # What still serves holds memory and workers, under each replica's group id.
        holding = {
            replica_group_id(d.deployment_id, r.index)
            for d in await self.store.list_deployments()
            for r in replicas.serving(d)
        }
        for owner in sorted(await self.store.reservation_owners()):
            if owner not in holding and not owner.startswith(PROFILING_OWNER_PREFIX):
                await self.store.release(owner)
                actions.append(f"released orphaned reservation {owner}")
        for deployment_id, workers in running.items():
            if deployment_id not in holding and not deployment_id.startswith(
                PROFILING_OWNER_PREFIX
            ):
                await self.controller.workers.stop_on(
                    sorted({w.node_id for w in workers}), deployment_id
                )
                actions.append(f"stopped orphaned workers of {deployment_id}")
        # Restarts in progress go on, now that no reservation of theirs can pass for an
        # orphan (they also wait for ``reconciled``).
        actions += await self.controller.healer.resume(await self.store.list_deployments())
        for line in actions:
            log.info("reconcile: %s", line)
        self.controller.reconciled.set()
        return actions

    async def check_workers(self) -> list[str]:
        """Restart the serving replicas whose workers their (answering) agents no longer
        run: an agent restarted on its own (its old workers stop with it), or the whole
        stack stopped and started while an agent was slow to answer. Returns what it did.

        Records are read before the agents are asked, so a replica started in between is
        not mistaken for one without workers."""
        deployments = await self.store.list_deployments()
        running, answered, known = await self._running_workers()
        actions = await self._fail_missing(
            deployments, running, answered, known, "its agent reports"
        )
        actions += await self.finish_cut_off(deployments, CUT_OFF)
        if not await self.store.state_format():
            # Redis lost every record (FLUSHALL; an empty Redis started in its place):
            # every worker looks unheld, and stopping them all took down what still
            # served, with a warning per group as the only trace (a tester).
            self._unheld_seen = set()
            serving = sum(len(workers) for workers in running.values())
            log.error(
                "the state store (Redis) lost its records (no %s key: flushed, or an "
                "empty Redis in its place): %d running worker(s) are left alone, not "
                "stopped as unheld; restore its backup and restart the stack "
                "(docs/operations.md, Backups of Redis), or stop the stack (iserve down)",
                keys.state_format(),
                serving,
            )
            return actions
        actions += await self._stop_unheld(running, known)
        return actions + await self._forget_orphaned_records(deployments)

    async def _forget_orphaned_records(self, deployments: list[deploy_pb.Deployment]) -> list[str]:
        """Delete the worker records of groups of no deployment, seen so at two checks in
        a row: an agent may write one after the deployment is gone (a start cancelled by
        a deploy that failed on another node, a worker's exit seen once a hung agent
        resumed after a remove), and nothing else ever deleted it (a probe). A Deploy
        under way, or a profiling job (its records expire), is left alone. ``deployments``
        were listed before the records are read: one made since is seen at the next check."""
        known = {d.deployment_id for d in deployments}
        orphaned = set()
        for group in await self.store.worker_groups():
            deployment_id, _ = split_group_id(group)
            if not (
                deployment_id in known
                or self.controller.deploying(deployment_id)
                or group.startswith(PROFILING_OWNER_PREFIX)
            ):
                orphaned.add(group)
        confirmed, self._orphaned_seen = orphaned & self._orphaned_seen, orphaned
        for group in sorted(confirmed):
            await self.store.delete_workers(group)
        return [
            f"forgot the worker records of {group}: no deployment has them"
            for group in sorted(confirmed)
        ]

    async def finish_cut_off(
        self, deployments: list[deploy_pb.Deployment], reason: str
    ) -> list[str]:
        """Fail (for ``reason``) the STARTING deployments that no Deploy here starts and no
        restart resumes, and finish removing the REMOVING ones that no Remove here
        removes: what a Deploy or Remove cut off mid-way leaves (by a restart of this
        service, or the state store going away as it rolled back, so the record, its
        reservation and any worker stayed). Each is read again under its lock, which the
        Deploy takes to end and the Remove holds throughout."""
        actions = []
        for listed in deployments:
            deployment_id = listed.deployment_id
            if listed.state not in (replicas.STARTING, deploy_pb.DEPLOYMENT_STATE_REMOVING):
                continue
            if self.controller.deploying(deployment_id):
                continue
            async with self.controller.lock(deployment_id):
                current = await self.store.get_deployment(deployment_id)
                if current is None or self.controller.deploying(deployment_id):
                    continue
                if current.state == deploy_pb.DEPLOYMENT_STATE_REMOVING:
                    await self.controller.workers.teardown(current)
                    await self.store.delete_deployment(current)
                    await self.store.publish_event(
                        "deployment_removed", deployment_id=deployment_id
                    )
                    actions.append(f"finished removing {deployment_id}")
                elif current.state == replicas.STARTING:
                    if await self.controller.healer.record_of(deployment_id) is not None:
                        continue  # a replica restarting
                    await self.controller.mark_failed(current, reason)
                    await self.controller.forget_request_of(current)
                    actions.append(f"failed {deployment_id}: {reason}")
        return actions

    async def _stop_unheld(
        self, running: dict[str, list[_NodeWorker]], known: set[tuple[str, str]]
    ) -> list[str]:
        """Stop the workers that no deployment holds on their node, seen so at two checks
        in a row: what outlived its replica where the agent could not be told to stop it
        (it was stopped or cut off while its deployment was removed, failed, or moved
        elsewhere), which would otherwise hold memory that is no longer reserved. So are
        the agent's records of such workers that exited since (``known``, live or not):
        nothing else stops them, and the agent kept their ports and ready files for good
        (a tester).

        The records are read after the agents answered, so every worker they reported
        was started under a record read here. A replica that is STARTING (being deployed,
        or restarted: its new placement is written once it serves) holds its group on any
        node, and so does a deployment being removed (the remove stops its workers)."""
        held: set[tuple[str, str]] = set()
        held_anywhere: set[str] = set()
        for dep in await self.store.list_deployments():
            for replica in replicas.replicas_of(dep):
                group = replica_group_id(dep.deployment_id, replica.index)
                if (
                    dep.state == deploy_pb.DEPLOYMENT_STATE_REMOVING
                    or dep.state == replicas.STARTING
                    or replica.state == replicas.STARTING
                ):
                    held_anywhere.add(group)
            for replica in replicas.serving(dep):
                group = replica_group_id(dep.deployment_id, replica.index)
                held.update((group, node) for node in replicas.nodes_of(replica.placement))
        unheld = {
            (group, node_id)
            for group, node_id in known
            if group not in held_anywhere
            and not group.startswith(PROFILING_OWNER_PREFIX)
            and (group, node_id) not in held
        }
        confirmed, self._unheld_seen = unheld & self._unheld_seen, unheld
        actions = []
        for group, node_id in sorted(confirmed):
            await self.controller.workers.stop_on([node_id], group)
            live = any(w.node_id == node_id for w in running.get(group, []))
            actions.append(
                f"stopped workers of {group} on {node_id}: no deployment holds them"
                if live
                else f"cleared exited workers of {group} on {node_id}: no deployment holds them"
            )
        return actions

    async def _fail_missing(
        self,
        deployments: list[deploy_pb.Deployment],
        running: dict[str, list[_NodeWorker]],
        answered: set[str],
        known: set[tuple[str, str]],
        when: str,
    ) -> list[str]:
        """Fail (to be restarted) each serving replica of ``deployments`` missing a rank
        among ``running``; nodes whose agents did not answer are left to the heartbeat
        check. A replica whose workers were stopped on purpose is restored instead,
        spending no restart budget; so is one lost with a restarted agent (a node whose
        agent has no record of its workers: ``known``), as a node that stopped
        heartbeating is. Counted as failures, one power loss spent a step of a
        deployment's budget per replica: five replicas, five steps, the deployment
        FAILED."""
        actions = []
        for dep in deployments:
            for replica in replicas.serving(dep):
                group = replica_group_id(dep.deployment_id, replica.index)
                if not set(replicas.nodes_of(replica.placement)) <= answered:
                    continue
                ranks = {w.rank for w in running.get(group, [])}
                missing = sorted(set(range(_rank_count(replica.placement))) - ranks)
                planned = self._was_stopped_on_purpose(group)
                if not missing:
                    continue
                forgotten = [
                    node
                    for node in replicas.nodes_of(replica.placement)
                    if (group, node) not in known
                ]
                back = await self.store.nodes_back_after_a_stop(forgotten)
                stopped_first = bool(forgotten) and back >= set(forgotten) and not planned
                lost_rank = bool(forgotten) and not planned and not stopped_first
                if planned:
                    reason = f"the stack was stopped on purpose, rank(s) {missing} with it"
                elif stopped_first:
                    # Its agent stopped cleanly and was back before a node check saw it.
                    reason = (
                        f"{_stopped_heartbeating(forgotten, forgotten)}, rank(s) {missing} with it"
                    )
                    planned = True
                elif lost_rank:
                    reason = f"{_restarted(forgotten)}, rank(s) {missing} with it"
                else:
                    reason = f"{when}, rank(s) {missing} are not running"
                if await self.controller.fail(group, reason, planned=planned, lost_rank=lost_rank):
                    # A planned loss is no failure: it is restored at once, on no budget
                    # (deploy.log read "failed" for deployments that then served again).
                    actions.append(f"{RESTORING if planned else 'failed'} {group}: {reason}")
        return actions

    async def _running_workers(
        self,
    ) -> tuple[dict[str, list[_NodeWorker]], set[str], set[tuple[str, str]]]:
        """Live workers by deployment, as the alive nodes' agents report them, the nodes
        whose agents answered, and the (group, node) pairs of every worker record they
        hold, live or not. The agents are asked together: one that hangs costs its
        timeout once, not once for every node after it."""
        listed = await self.store.list_nodes()
        self.controller.workers.reach.forget_lapsed(listed)
        nodes = [node for node in listed if node.alive]
        replies = await asyncio.gather(
            *(
                self.agents.stub(node.agent_address).ListWorkers(
                    agent_pb.ListWorkersRequest(), timeout=LIST_TIMEOUT_S
                )
                for node in nodes
            ),
            return_exceptions=True,
        )
        running: dict[str, list[_NodeWorker]] = {}
        answered: set[str] = set()
        known: set[tuple[str, str]] = set()
        for node, reply in zip(nodes, replies, strict=True):
            if isinstance(reply, grpc.RpcError):
                if reply.code() == grpc.StatusCode.UNAVAILABLE:
                    self.controller.workers.reach.unreachable(
                        node.agent_address, reply.details() or ""
                    )
                if self._unanswered_logged.get(node.node_id) != reply.code():
                    # Once per spell (it is asked every few seconds), on one line.
                    log.warning(
                        "reconcile: agent of %s at %s did not answer: %s: %s",
                        node.node_id,
                        node.agent_address,
                        reply.code().name,
                        " ".join((reply.details() or "").split()),
                    )
                    self._unanswered_logged[node.node_id] = reply.code()
                continue
            if isinstance(reply, BaseException):
                raise reply
            self.controller.workers.reach.answered(node.agent_address)
            if self._unanswered_logged.pop(node.node_id, None) is not None:
                log.info("reconcile: agent of %s answers again", node.node_id)
            answered.add(node.node_id)
            for w in reply.workers:
                known.add((w.deployment_id, node.node_id))
                if w.state in (agent_pb.WORKER_STATE_STARTING, agent_pb.WORKER_STATE_READY):
                    running.setdefault(w.deployment_id, []).append(
                        _NodeWorker(node.node_id, w.rank)
                    )
        return running, answered, known

    async def handle(self, event: dict) -> None:
        deployment_id = event.get("deployment_id", "")
        kind = event.get("kind")
        if not deployment_id:
            return
        if kind == "worker_died":
            if not await self._current(deployment_id, node_id=event.get("node_id", "")):
                return
            said = f"worker rank {event.get('rank')} exited ({event.get('exit_code')})"
            await self._lost(deployment_id, _with_reason(said, event))
        elif kind == "worker_unreachable":
            address = event.get("worker_address", "")
            if not address or not await self._current(deployment_id, address=address):
                return
            status = await worker_status(address)
            if status != "SERVING":
                # One that does not answer at all (hung: SIGSTOP, a stuck kernel) drains
                # nothing: its workers are stopped without waiting out the drain.
                reason = _with_reason("worker unreachable", event)
                await self._lost(deployment_id, reason, unresponsive=status == "UNREACHABLE")

    async def _lost(self, group: str, reason: str, *, unresponsive: bool = False) -> None:
        """``controller.fail`` for a replica whose worker is gone: a restore, spending no
        restart budget, when its workers were stopped on purpose (a clean stop of the
        stack) and no agent has answered for them since. The scheduler, which still has
        the old worker's address, often reports it unreachable before the agents answer
        the deployer, and each such restart of the stack cost a step of the budget."""
        planned = self._was_stopped_on_purpose(group)
        if planned:
            reason = f"the stack was stopped on purpose ({reason})"
            await self.controller.fail(group, reason, planned=True)
            return
        lost = await self._lost_node(group)
        if lost:
            reason = f"{lost} ({reason})"
        await self.controller.fail(group, reason, lost_rank=bool(lost), unresponsive=unresponsive)

    async def _lost_node(self, group: str) -> str:
        """Why a node of ``group``'s replica is lost ("" when every one lives and its
        agent answers with a record of the replica's workers). A worker's loss often
        reaches the deployer before its node's heartbeat lapses: the scheduler finds the
        worker gone, or a surviving rank its pipeline peer, at once, where the lapse
        takes seconds; counted as the worker's fault, each node loss spent the budget (a
        probe: 3 of 5 steps in four losses)."""
        replica = await self._replica(group)
        if replica is None:
            return ""
        on = set(replicas.nodes_of(replica.placement))
        nodes = [n for n in await self.store.list_nodes() if n.node_id in on]
        dead = sorted(on - {n.node_id for n in nodes if n.alive})
        if dead:
            return _stopped_heartbeating(dead, replicas.stopped_nodes(nodes))
        replies = await asyncio.gather(
            *(
                self.agents.stub(n.agent_address).ListWorkers(
                    agent_pb.ListWorkersRequest(deployment_id=group), timeout=NODE_CHECK_TIMEOUT_S
                )
                for n in nodes
            ),
            return_exceptions=True,
        )
        gone, forgotten = [], []
        for node, reply in zip(nodes, replies, strict=True):
            if isinstance(reply, grpc.RpcError) and reply.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                self.controller.workers.reach.unreachable(node.agent_address, reply.details() or "")
                gone.append(node.node_id)
            elif isinstance(reply, agent_pb.ListWorkersResponse) and not reply.workers:
                forgotten.append(node.node_id)
        if gone:
            return f"node agent(s) {', '.join(gone)} do not answer"
        return _restarted(forgotten) if forgotten else ""

    def _was_stopped_on_purpose(self, group: str) -> bool:
        """Whether ``group``'s workers were stopped on purpose and nothing was heard of
        them since; asked once per group: what is heard next is news."""
        planned = group in self._stopped_on_purpose
        self._stopped_on_purpose.discard(group)
        return planned

    async def _replica(self, group: str) -> deploy_pb.Replica | None:
        """``group``'s replica as Redis holds it now; None when it or its deployment is
        gone."""
        deployment_id, index = split_group_id(group)
        deployment = await self.store.get_deployment(deployment_id)
        if deployment is None:
            return None
        return next((r for r in replicas.replicas_of(deployment) if r.index == index), None)

    async def _current(self, group: str, *, node_id: str = "", address: str = "") -> bool:
        """Whether an event about a worker of ``group`` on ``node_id`` (or at ``address``)
        is about the replica as it is now. A late report of a worker the replica had before
        a restart (a scheduler that cached its old address, an agent cut off while the
        replica moved to another node) must not fail the replica that replaced it."""
        replica = await self._replica(group)
        if replica is None:
            return False
        if address:
            return replica.worker_address == address
        return not node_id or node_id in replicas.nodes_of(replica.placement)

    async def check_nodes(self) -> None:
        """Take out the serving replicas on nodes whose agents stopped heartbeating, and
        forget the nodes dead for longer than ``ISERVE_NODE_FORGET_AFTER_S`` that hold
        no reserved memory (``iserve status`` lists a dead node until then, with when it
        was last seen)."""
        nodes = await self.store.list_nodes()
        alive = {n.node_id for n in nodes if n.alive}
        stopped = replicas.stopped_nodes(nodes)
        forget_after_s = float(getattr(self.controller.settings, "node_forget_after_s", 0.0))
        if forget_after_s > 0:
            unseen_since_ms = int(time.time() * 1000 - forget_after_s * 1000)
            for node in nodes:
                if (
                    not node.alive
                    and node.heartbeat_at_unix_ms < unseen_since_ms
                    and await self.store.forget_node(node.node_id, unseen_since_ms)
                ):
                    log.warning(
                        "forgot node %s: dead for more than %g s", node.node_id, forget_after_s
                    )
        lost = []
        for deployment in await self.store.list_deployments():
            for replica in replicas.serving(deployment):
                dead = set(replicas.nodes_of(replica.placement)) - alive
                if dead:
                    lost.append(
                        self.controller.fail(
                            replica_group_id(deployment.deployment_id, replica.index),
                            _stopped_heartbeating(dead, stopped),
                            lost_rank=True,
                        )
                    )
        # Side by side (each under its own deployment's lock): a group whose rank on the
        # live node cannot drain held every other replica of the dead node in service, to
        # be routed to, for the length of its stop (35 s and more).
        outcomes = await asyncio.gather(*lost, return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            raise failures[0]  # as before, to the loop (Redis down: its grace window)

    async def run(self) -> None:
        last = await self.store.last_event_id()
        while True:
            try:
                await self.reconcile_on_start()
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retry until Redis and the agents answer
                said = f"{type(exc).__name__}: {exc}"
                if said != self.controller.reconcile_error:  # once, not each second
                    log.exception("start-up reconciliation failed; retrying each second")
                self.controller.reconcile_error = said
                await asyncio.sleep(1.0)
        self.controller.reconcile_error = ""
        loop = asyncio.get_running_loop()
        workers_checked_at = loop.time()
        # The agents are asked beside the loop, so that one slow to answer (up to
        # LIST_TIMEOUT_S) holds up neither the events nor the heartbeat check.
        workers_check: asyncio.Task | None = None
        # After Redis was unreachable, heartbeats may have lapsed while the agents could
        # not renew them: nodes are judged again only once they had a TTL to do so.
        judge_nodes_from = 0.0
        heartbeat_ttl_s = float(getattr(self.controller.settings, "heartbeat_ttl_s", 5.0))
        try:
            while True:
                try:
                    for event_id, event in await self.store.read_events(last, block_ms=1000):
                        last = event_id
                        await self.handle(event)
                    if loop.time() >= judge_nodes_from:
                        await self.check_nodes()
                    idle = workers_check is None or workers_check.done()
                    if idle and loop.time() - workers_checked_at >= WORKER_CHECK_INTERVAL_S:
                        workers_checked_at = loop.time()
                        workers_check = loop.create_task(self._check_workers_logged())
                except asyncio.CancelledError:
                    raise
                except StateStoreUnavailable as exc:
                    log.warning("reconciliation paused: %s", exc)
                    judge_nodes_from = loop.time() + heartbeat_ttl_s + 1.0
                    await asyncio.sleep(1.0)
                except Exception:  # noqa: BLE001 - the loop must survive a bad event or a Redis blip
                    log.exception("reconciliation step failed")
                    await asyncio.sleep(1.0)
        finally:
            if workers_check is not None:
                await cancel_and_wait([workers_check])

    async def _check_workers_logged(self) -> None:
        try:
            for line in await self.check_workers():
                level = logging.INFO if line.startswith(RESTORING) else logging.WARNING
                log.log(level, "reconcile: %s", line)
        except StateStoreUnavailable as exc:
            log.warning("workers check skipped: %s", exc)
        except Exception:  # noqa: BLE001 - the next check runs all the same
            log.exception("workers check failed")
