"""Which deployment serves a request.

Deployment records are cached in memory so the hot path does no Redis round trip: the
cache is refreshed from Redis every ~1 s by a background task, on a miss, and when a
cached record is not READY (it may have become ready since the last refresh).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from scheduler_svc.deadlines import decode_alone_passes
from scheduler_svc.validation import resolve_max_tokens
from services import errors, replicas
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as inference_pb
from services.auth import access
from services.errors import (
    ModelNotFound,
    NotFound,
    NotServing,
    PermissionDenied,
    Unavailable,
)
from services.ids import check_deployment_id, check_model_id, no_deployment
from services.state.store import StateStore

log = logging.getLogger("iserve.scheduler.routing")

READY = deploy_pb.DEPLOYMENT_STATE_READY
STARTING = deploy_pb.DEPLOYMENT_STATE_STARTING
REMOVING = deploy_pb.DEPLOYMENT_STATE_REMOVING
REFRESH_INTERVAL_S = 1.0

Backlog = Callable[[deploy_pb.Deployment], float]
"""How long a request would wait on a deployment, seconds (``QueueRegistry.shortest_wait``)."""
DecodeStep = Callable[[deploy_pb.Deployment], float | None]
"""A deployment's fastest decode step, seconds, as its measurements say (None: nothing to
say it from)."""
OnRefresh = Callable[[list[deploy_pb.Deployment]], Awaitable[None]]


def unreachable_first(
    candidates: list[deploy_pb.Deployment],
    request: inference_pb.GenerateRequest,
    max_tokens_is_bound: bool,
    arrival_s: float,
    decode_step_s: DecodeStep,
) -> list[deploy_pb.Deployment]:
    """``candidates`` (a model's, shortest wait first) with those whose measurements say
    the request's own decode alone passes its own deadline moved first, the order kept
    otherwise: such a deployment refuses it as unreachable, and one that can predict
    nothing then repeats that refusal. A request with such a deadline was served late,
    with success, by a deployment of the model that had measured nothing yet (a tester:
    64 tokens due in 1 ms, served in 441 ms); a new deployment sorted last for all
    requests took no deadline traffic at all."""
    if request.deadline_ms <= 0 or len(candidates) < 2:
        return candidates

    def hopeless(deployment: deploy_pb.Deployment) -> bool:
        step = decode_step_s(deployment)
        if step is None:
            return False
        probe = inference_pb.GenerateRequest(
            max_tokens=0 if max_tokens_is_bound else request.max_tokens,
            max_tokens_default=request.max_tokens_default,
        )
        resolve_max_tokens(probe, deployment)
        return decode_alone_passes(
            arrival_s,
            common.ServiceObjectives(),  # the request's deadline, not the deployment's
            request.deadline_ms,
            probe.max_tokens,
            step,
        )

    return sorted(candidates, key=lambda d: not hopeless(d))


def state_name(deployment: deploy_pb.Deployment) -> str:
    """``STARTING``, ``FAILED``… for messages."""
    name = deploy_pb.DeploymentState.Name(deployment.state)
    return name.removeprefix("DEPLOYMENT_STATE_")


def describe_state(deployment: deploy_pb.Deployment) -> str:
    """``deployment d1 is FAILED: worker exited`` (the reason only when there is one)."""
    text = f"deployment {deployment.deployment_id} is {state_name(deployment)}"
    reason = replicas.reason_summary(deployment.state_reason)
    return f"{text}: {reason}" if reason else text


def pinned(request: inference_pb.GenerateRequest, deployment_id: str) -> bool:
    """Whether ``request`` names ``deployment_id`` itself: by ``deployment_id``, or by
    that id where a model's goes (the gateway's ``model``, the one way over HTTP). Such
    a request is served as a deployment's: an HTTP request pinned so was refused late by
    FCFS, as a model's request is, where gRPC's deployment_id was served (a tester)."""
    return request.HasField("deployment_id") or request.model_id == deployment_id


def _unknown(deployment_id: str) -> NotFound:
    """What a request for a deployment that does not exist gets."""
    return NotFound(f"deployment {deployment_id} not found")


def _passing(deployment: deploy_pb.Deployment) -> bool:
    """A state that passes on its own: starting, removing (a successor may be starting),
    or a replica being restarted."""
    return replicas.is_restarting(deployment) or deployment.state in (STARTING, REMOVING)


def answered_refusal(
    refusals: list[tuple[deploy_pb.Deployment, errors.IServeError]], own_deadline: bool
) -> tuple[deploy_pb.Deployment, errors.IServeError]:
    """The refusal a model's request gets when every deployment of the model refused it
    at admission (``refusals``, in the order they were tried): the first, except that a
    request without a deadline of its own is told of a full queue (RESOURCE_EXHAUSTED,
    429 with Retry-After: try again later) rather than of an EDF deployment's objective
    it would miss (DEADLINE_EXCEEDED, 504), which is the same overload."""
    if not own_deadline:
        for deployment, refused in refusals:
            if isinstance(refused, errors.ResourceExhausted):
                return deployment, refused
    return refusals[0]


class Router:
    """Resolves a request's target to a READY deployment, from a cache of Redis records."""

    def __init__(self, store: StateStore, backlog: Backlog):
        self._store = store
        self._backlog = backlog
        self._by_id: dict[str, deploy_pb.Deployment] = {}
        # True once a full refresh has run: until then the cache may hold only the
        # deployments looked up by id, too few to choose among a model's deployments.
        self._complete = False

    def deployments(self) -> list[deploy_pb.Deployment]:
        """The cached records."""
        return list(self._by_id.values())

    async def by_deployment_id(self, deployment_id: str) -> deploy_pb.Deployment:
        """The deployment, which must be READY and usable by the caller.

        NOT_FOUND when unknown, and to a user whose token does not grant it;
        PERMISSION_DENIED when a developer does not own it (services.auth.access);
        UNAVAILABLE while it starts or is being restarted (a retry will find it serving);
        FAILED_PRECONDITION naming its state (and why) otherwise.
        """
        deployment = self._by_id.get(deployment_id)
        if deployment is not None and deployment.state == READY:
            access.check_use(deployment_id, deployment.owner, unknown=_unknown(deployment_id))
            return deployment
        check_deployment_id(deployment_id)
        deployment = await self._store.get_deployment(deployment_id)
        if deployment is None:
            self._by_id.pop(deployment_id, None)
            raise _unknown(deployment_id)
        self._by_id[deployment_id] = deployment
        access.check_use(deployment_id, deployment.owner, unknown=_unknown(deployment_id))
        if replicas.is_restarting(deployment) or deployment.state == STARTING:
            raise Unavailable(describe_state(deployment))  # back soon: worth a retry
        if deployment.state != READY:
            raise NotServing(describe_state(deployment))
        return deployment

    async def by_model_id(self, model_id: str) -> deploy_pb.Deployment:
        """The READY deployment of ``model_id`` with the shortest expected wait (the first
        of :meth:`ranked_for_model`)."""
        return (await self.ranked_for_model(model_id))[0]

    async def ranked_for_model(self, model_id: str) -> list[deploy_pb.Deployment]:
        """The READY deployments of ``model_id`` the caller may use, shortest expected
        wait first (at least one).

        NOT_FOUND when the model has no deployment; when none is READY, UNAVAILABLE if one
        of them is starting, removing or being restarted, else FAILED_PRECONDITION,
        listing their states; PERMISSION_DENIED when a developer owns none of the READY
        ones. A user's token sees only the deployments it grants (access.visible), so a
        model with none of those is to it a model with no deployment.

        A deployment's id where a model's goes (the gateway's ``model``, which has no
        field of its own for it) names that deployment alone, as :meth:`by_deployment_id`
        resolves it: the one way over HTTP to pin a request to one of a model's
        deployments (another compression of it answers otherwise, a probe).
        """
        if not self._complete:
            await self.refresh()
        ready = access.visible(self._ready_of(model_id))
        if not ready and model_id in self._by_id:
            return await self._named_deployment(model_id)
        if not ready:
            check_model_id(model_id)
            found = await self._store.list_deployments(model_id)
            for deployment in found:
                self._by_id[deployment.deployment_id] = deployment
            found = access.visible(found)
            ready = [d for d in found if d.state == READY]
            if not found:
                if await self._store.get_deployment(model_id) is not None:
                    return await self._named_deployment(model_id)
                raise ModelNotFound(no_deployment(model_id))
            if not ready:
                states = "; ".join(describe_state(d) for d in found)
                # A model being deployed, redeployed or restarted serves again soon: a
                # client should retry (503), not give up (400).
                error = Unavailable if any(_passing(d) for d in found) else NotServing
                raise error(f"model {model_id} has no READY deployment ({states})")
        usable = access.usable(ready)
        if not usable:
            raise PermissionDenied(
                f"{access.caller().describe()} may use no deployment of model {model_id}"
            )
        if len(usable) == 1:
            return usable
        return sorted(usable, key=self._backlog)

    async def _named_deployment(self, deployment_id: str) -> list[deploy_pb.Deployment]:
        """[the deployment] a model's id that is a deployment's names; to a caller who may
        not see it, what a model with no deployment gets (not "deployment … not found",
        which would tell that one exists)."""
        try:
            return [await self.by_deployment_id(deployment_id)]
        except NotFound:
            raise ModelNotFound(no_deployment(deployment_id)) from None

    def refused_for_model(self, model_id: str) -> deploy_pb.Deployment | None:
        """The cached deployment a refusal of ``model_id``'s request is counted against
        when none took it (none READY): the first the caller may see that is starting or
        being restarted (the one that will serve it), else the first it may see; None when
        the caller sees none (an id nobody deployed gets no metric series)."""
        found = access.visible([d for d in self._by_id.values() if d.model_id == model_id])
        return next((d for d in found if _passing(d)), found[0] if found else None)

    def cached(self, deployment_id: str) -> deploy_pb.Deployment | None:
        """The newest record of the deployment this router holds (None: none), as the last
        refresh or lookup read it."""
        return self._by_id.get(deployment_id)

    def forget(self, deployment_id: str) -> None:
        """Drop a cached record, so the next request for it reads Redis."""
        self._by_id.pop(deployment_id, None)

    async def refresh(self) -> None:
        """Replace the cache with every deployment record in Redis."""
        found = await self._store.list_deployments()
        self._by_id = {d.deployment_id: d for d in found}
        self._complete = True

    async def refresh_forever(
        self, interval_s: float = REFRESH_INTERVAL_S, on_refresh: OnRefresh | None = None
    ) -> None:
        """Refresh every ``interval_s`` seconds until cancelled, then call ``on_refresh``
        with the records. Logs when Redis fails and when it recovers, not every time."""
        failing = False
        while True:
            try:
                await self.refresh()
                if on_refresh is not None:
                    await on_refresh(self.deployments())
            except Exception as exc:  # noqa: BLE001 - keep serving from the cache
                if not failing:
                    log.warning("cannot refresh deployments from Redis: %s", exc)
                failing = True
            else:
                if failing:
                    log.info("deployment refresh from Redis works again")
                failing = False
            await asyncio.sleep(interval_s)

    def _ready_of(self, model_id: str) -> list[deploy_pb.Deployment]:
        return [d for d in self._by_id.values() if d.model_id == model_id and d.state == READY]


def stats_for_caller(stats: Iterable, deployments: Iterable[deploy_pb.Deployment]) -> list:
    """The serving statistics (records with ``deployment_id``) the caller may read: those
    of the deployments it may generate on (``access.may_use``: a developer its own,
    administrators all), owners read from ``deployments``. Another tenant's request
    volumes and latencies are its own business."""
    owners = {d.deployment_id: d.owner for d in deployments}
    return [s for s in stats if access.may_use(s.deployment_id, owners.get(s.deployment_id, ""))]
