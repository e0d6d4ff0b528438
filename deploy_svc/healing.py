"""When and where a failed replica starts again. Pure: no gRPC, no Redis.

A replica whose worker dies (or whose node stops heartbeating, or whose workers are gone
after a restart of the stack) is taken out: its workers are stopped and its memory
released. Then, as Ray Serve restarts replicas, it is placed and launched again after an
exponential backoff (:meth:`RestartPolicy.backoff_s`), its old devices first. A
deployment gets ``max_restarts`` restarts in a row; a failure more than
``reset_after_s`` after the one before starts a fresh run (it served in between). A
failed restart counts as a failure; a node lost (its heartbeat lapsed) is none, and its
replicas start again at once. Once the budget is spent the replica stays out, and when
no other replica serves the deployment is FAILED saying why. A start refused for a
reason no retry changes (its checkpoint gone from the models root, or rewritten as
another model) takes the replica out at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from deploy_svc import placement
from deploy_svc.planning import placement_of
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from services.replicas import WAITING_FOR_NODE, stopped_nodes
from services.reservation import memory_blocks
from services.settings import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_BACKOFF_S


@dataclass(frozen=True)
class RestartPolicy:
    """Bounded retries with exponential backoff (seconds)."""

    max_restarts: int = DEFAULT_MAX_RESTARTS
    first_backoff_s: float = DEFAULT_RESTART_BACKOFF_S
    max_backoff_s: float = 30.0
    reset_after_s: float = 600.0

    @classmethod
    def of(cls, settings) -> RestartPolicy:
        """The policy ``ISERVE_MAX_RESTARTS`` and ``ISERVE_RESTART_BACKOFF_S`` set; the
        backoff doubles up to 30 s, or the first backoff when that is longer."""
        first = settings.restart_backoff_s
        return cls(
            max_restarts=settings.max_restarts,
            first_backoff_s=first,
            max_backoff_s=max(cls.max_backoff_s, first),
        )

    def backoff_s(self, restart: int) -> float:
        """How long to wait before the ``restart``-th restart of a run (1-based):
        ``first_backoff_s``, doubling each time, at most ``max_backoff_s``."""
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(0, restart - 1))


@dataclass(frozen=True)
class RestartRecord:
    """What is kept per deployment about its restarts (JSON in Redis)."""

    in_a_row: int = 0  # restarts in the current run of failures: what the budget counts
    total: int = 0  # restarts over the deployment's life
    last_error: str = ""
    last_failure_ms: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RestartRecord:
        return cls(**json.loads(text))


# The STARTING note of a replica started again after a stop on purpose.
RESTORING = "starting again: "


@dataclass(frozen=True)
class Restart:
    """Start the replica again after ``delay_s``; ``record`` is to be stored. A
    ``restore`` is no failure's restart (the stack was stopped on purpose); a
    ``node_lost`` restart spends no budget."""

    delay_s: float
    record: RestartRecord
    restore: str = ""
    node_lost: bool = False

    @property
    def note(self) -> str:
        if self.restore:
            return f"{RESTORING}{self.restore}"
        if self.node_lost:
            return f"restart now after: {self.record.last_error} (no restart budget spent)"
        return (
            f"restart {self.record.in_a_row} in {self.delay_s:g} s after: {self.record.last_error}"
        )


@dataclass(frozen=True)
class GiveUp:
    """The budget is spent; ``reason`` says so and names the last error."""

    reason: str
    record: RestartRecord


def after_failure(
    policy: RestartPolicy, record: RestartRecord | None, error: str, now_ms: int
) -> Restart | GiveUp:
    """What to do about a failure (``error``) of a deployment's replica at ``now_ms``,
    given what happened before (``record``, None when it never failed)."""
    record = record or RestartRecord()
    in_a_row = record.in_a_row
    if record.last_failure_ms and now_ms - record.last_failure_ms >= policy.reset_after_s * 1000:
        in_a_row = 0
    if in_a_row >= policy.max_restarts:
        spent = RestartRecord(in_a_row, record.total, error, now_ms)
        return GiveUp(
            f"gave up after {in_a_row} restart(s) in a row "
            f"(at most {policy.max_restarts}); last error: {error}",
            spent,
        )
    nth = in_a_row + 1
    return Restart(policy.backoff_s(nth), RestartRecord(nth, record.total + 1, error, now_ms))


def after_node_loss(record: RestartRecord | None, error: str) -> Restart:
    """A replica whose node stopped heartbeating (``error``): no fault of the replica's,
    so it is placed again at once on live devices and spends no budget: it counts in
    ``total`` (its READY note then names the loss), not in ``in_a_row``, and the time of
    the last failure stays. Counted, one correlated loss (a rack's nodes at once) took
    out for good every replica past the budget, though each had room elsewhere."""
    record = record or RestartRecord()
    kept = RestartRecord(record.in_a_row, record.total + 1, error, record.last_failure_ms)
    return Restart(0.0, kept, node_lost=True)


def refused(record: RestartRecord | None, error: str, now_ms: int) -> GiveUp:
    """A start refused for a reason no restart changes (``error``: its checkpoint gone or
    rewritten as another model): the replica is taken out at once, the budget unspent."""
    record = record or RestartRecord()
    return GiveUp(
        f"not restarted: {error} (every restart would be refused the same way)",
        RestartRecord(record.in_a_row, record.total, error, now_ms),
    )


def restore(record: RestartRecord | None, why: str) -> Restart:
    """Start a replica whose workers were stopped on purpose (``why``) again at once,
    spending no restart budget: its record stays as it was."""
    return Restart(0.0, record or RestartRecord(), restore=why)


def served_again_note(record: RestartRecord, restoring_note: str = "") -> str:
    """The state reason of a replica serving again after a restart, or after a restore
    (its STARTING note ``restoring_note`` says which): a restore names no failure, which
    would be another replica's, or one from before the stop. A restart names how many
    restarts in a row count against the budget."""
    if not record.total or restoring_note.startswith(RESTORING):
        return "serves again after a stop of the stack"
    # How many count against the budget: restarts after node losses spend none, and
    # "restarted 5 time(s)" read as a budget of 5 spent.
    counted = record.in_a_row or "none"
    return (
        f"restarted {record.total} time(s) ({counted} in a row against the restart "
        f"budget); last error: {record.last_error}"
    )


def where(placement: common.Placement) -> str:
    """A placement's devices, for messages: ``node-0/cpu0,node-0/cpu1``."""
    return ",".join(f"{node}/{device}" for node, device in sorted(_devices(placement)))


def _devices(where: common.Placement) -> set[tuple[str, str]]:
    return {(d.node_id, d.device_id) for stage in where.stages for d in stage.devices}


def _out(
    node_ids: Iterable[str], unanswered: Mapping[str, str], stopped: Iterable[str] = ()
) -> str:
    """Why ``node_ids`` are out: "node(s) A, B stopped heartbeating", "node(s) D
    stopped on purpose" for those whose agents stopped cleanly (``stopped``), and for
    each whose agent heartbeats but did not answer the deployer, "node C: its agent does
    not answer (why)"."""
    planned = sorted(set(node_ids) & set(stopped) - unanswered.keys())
    lapsed = sorted(n for n in node_ids if n not in unanswered and n not in planned)
    parts = [f"node(s) {', '.join(lapsed)} stopped heartbeating"] if lapsed else []
    if planned:
        parts.append(f"node(s) {', '.join(planned)} stopped on purpose")
    parts += [
        f"node {n}: its agent does not answer ({unanswered[n]})"
        for n in sorted(set(node_ids) & unanswered.keys())
    ]
    return "; ".join(parts)


def waiting_for_nodes(
    old: common.Placement,
    nodes: Sequence[common.NodeState],
    unanswered: Mapping[str, str] | None = None,
) -> str:
    """Why a replica placed on ``old``, for which the live devices have no placement
    now, waits for a node rather than spending its restart budget; "" when it does not.

    It waits while a node it ran on is still registered but has stopped heartbeating (an
    agent restarting, a host rebooting): that node may come back, and with it the room.
    Once the node's record is forgotten (``ISERVE_NODE_FORGET_AFTER_S``), or while every
    node it ran on lives, it is room that lacks and the restarts count. It also waits
    while no live node has a device of the hardware types it ran on (any device, when
    its nodes are no longer listed). ``unanswered``: the nodes taken as not alive because
    their agents did not answer (node id -> why), as said of them."""
    unanswered = unanswered or {}
    stopped = stopped_nodes(nodes)
    used = _devices(old)
    on = {node for node, _ in used}
    hardware = {
        d.hardware_type
        for n in nodes
        for d in n.devices
        if (d.ref.node_id, d.ref.device_id) in used
    }
    live = [d for n in nodes if n.alive for d in n.devices]
    if not any(not hardware or d.hardware_type in hardware for d in live):
        kind = f" with {', '.join(sorted(hardware))} devices" if hardware else ""
        return (
            f"{WAITING_FOR_NODE}a live node{kind}: {_out(on, unanswered, stopped)}; it starts "
            "again once "
            "one is back (no restart budget is spent meanwhile)"
        )
    dead = sorted(n.node_id for n in nodes if not n.alive and n.node_id in on)
    if dead:
        if (unanswered.keys() | stopped) & set(dead):
            why = _out(dead, unanswered, stopped)
        else:
            why = f"node(s) {', '.join(dead)}: stopped heartbeating"
        return (
            f"{WAITING_FOR_NODE}{why}, and the live nodes cannot hold it now; it starts again "
            "once they are back or there is room (no restart budget is spent meanwhile)"
        )
    return ""


def held_placements(deployment: deploy_pb.Deployment, index: int) -> list[common.Placement]:
    """The placements of the replicas of ``deployment`` other than ``index`` that hold
    their devices now: those that serve. A replica waiting to restart holds nothing (its
    memory was released with its workers); counted, two pipeline replicas across a lost
    node each kept the other off the live node's devices, and the whole deployment
    waited for the node though one replica had room there (found by a probe)."""
    return [
        r.placement
        for r in deployment.replicas
        if r.index != index and r.state == deploy_pb.DEPLOYMENT_STATE_READY
    ]


def gone_devices(old: common.Placement, nodes: Sequence[common.NodeState]) -> list[str]:
    """The devices of ``old`` ("node/device") that no alive node has now."""
    live = {(n.node_id, d.ref.device_id) for n in nodes if n.alive for d in n.devices}
    return [f"{node}/{device}" for node, device in sorted(_devices(old) - live)]


def placements_to_try(
    model: model_pb.Model,
    config: common.DeploymentConfig,
    old: common.Placement,
    nodes: Sequence[common.NodeState],
    others: Sequence[common.Placement],
    max_seq_len: int,
) -> list[common.Placement]:
    """Where a replica may start again, best first: its old placement while every node
    of it is alive and no other replica (``others``) serves on one of its devices (one
    that moved onto them while this one waited for its node: back on its old placement,
    two replicas shared a device), then a fresh placement (hybrid policy) on alive devices of the same
    hardware type that no other replica (``others``) uses, away from the old devices when
    the old placement was offered (should starting there fail, a device may be broken),
    else on any of them too (one filled up meanwhile: the others may still serve), each
    rank reserving what a rank of the old placement reserved per layer. Empty when
    nothing fits."""
    taken = set().union(*(_devices(p) for p in others)) if others else set()
    found: list[common.Placement] = []
    # Its devices, not only its nodes: a node back with fewer devices does not have the
    # old placement to offer (its reservation failed, "device ... is unknown", at every
    # restart; a tester).
    if not gone_devices(old, nodes) and not _devices(old) & taken:
        found.append(old)
    first = old.stages[0]
    hardware = {
        d.hardware_type
        for n in nodes
        for d in n.devices
        if (d.ref.node_id, d.ref.device_id) in _devices(old)
    }
    fixed, _ = memory_blocks(model.shape, config, max_seq_len)
    block = max(0, first.reserved_bytes[0] - fixed) // max(1, first.layer_count)
    usable = [c for c in placement.candidates(nodes) if not hardware or c.hardware_type in hardware]
    for excluded in (taken | _devices(old), taken) if found else (taken,):
        choice = placement.place(
            [c for c in usable if (c.node_id, c.device_id) not in excluded],
            tp=config.tensor_parallel,
            pp=config.pipeline_parallel,
            num_layers=model.shape.num_layers,
            fixed_bytes=fixed,
            layer_bytes=block,
            policy="hybrid",
        )
        if choice is not None:
            fresh = placement_of(choice)
            if _devices(fresh) != _devices(old):
                found.append(fresh)
                break
    return found
