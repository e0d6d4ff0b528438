"""Async access to iserve's state in Redis.

Capacity changes (reserve / release of device memory) run as Lua scripts, so two
deployers can never oversubscribe a device: a reservation either fits on every device
it names and is recorded whole, or changes nothing.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    WatchError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import estimator_service_pb2 as estimator_pb
from services.api import model_service_pb2 as model_pb
from services.api import token_service_pb2 as token_pb
from services.errors import AlreadyExists, ModelNotFound, Unavailable
from services.ids import check_model_id, replica_group_id
from services.state import keys
from services.state.capacity import FREE_BYTES_LUA, free_bytes
from services.state.records import decode, encode, encode_compact

EVENTS_MAXLEN = 10_000
# A call to a Redis that is down fails after these (seconds) instead of hanging; longer
# than any blocking read (``read_events`` waits 1 s).
CONNECT_TIMEOUT_S = 2.0
REPLY_TIMEOUT_S = 10.0
RECONNECT_RETRIES = 2
# Connections one process holds at most. A call beyond them waits for one to come free
# (up to POOL_WAIT_S) rather than failing at once, as redis-py's default pool does at
# 100: a burst of a few hundred concurrent calls is load, not an outage.
POOL_CONNECTIONS = 128
POOL_WAIT_S = REPLY_TIMEOUT_S
# redis-py's BlockingConnectionPool says this when POOL_WAIT_S passes with none free.
_POOL_EXHAUSTED = "No connection available."

# KEYS: reservation, reservation index, device keys…  ARGV: owner, bytes per device…
# Returns {1} on success, {0, i, free} when device i lacks room, {-1, i} when device i
# is unknown, {-2} when the owner already holds a reservation.
_RESERVE = f"""
if redis.call('EXISTS', KEYS[1]) == 1 then return {{-2}} end
for i = 3, #KEYS do
  local total = tonumber(redis.call('HGET', KEYS[i], 'total'))
  if not total then return {{-1, i - 3}} end
  local used = tonumber(redis.call('HGET', KEYS[i], 'used') or '0')
  local reserved = tonumber(redis.call('HGET', KEYS[i], 'reserved') or '0')
  local free = {FREE_BYTES_LUA}
  if free < tonumber(ARGV[i - 1]) then return {{0, i - 3, free}} end
end
for i = 3, #KEYS do
  redis.call('HINCRBY', KEYS[i], 'reserved', ARGV[i - 1])
  redis.call('HSET', KEYS[1], KEYS[i], ARGV[i - 1])
end
redis.call('SADD', KEYS[2], ARGV[1])
return {{1}}
"""

# KEYS: reservation, reservation index.  ARGV: owner.  Returns devices released (a
# device that no longer exists is skipped, not recreated).
_RELEASE = """
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  -- A device its node no longer registers is gone, and its counters with it.
  if redis.call('EXISTS', entries[i]) == 1 then
    local left = redis.call('HINCRBY', entries[i], 'reserved', -tonumber(entries[i + 1]))
    if left < 0 then redis.call('HSET', entries[i], 'reserved', 0) end
  end
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return #entries / 2
"""

# KEYS: the state-format key.  ARGV: this iserve's format.  Returns the format stored
# before (0 when none) and stores the larger of the two, in one step: two services of
# different versions starting together must not leave the older one's number behind.
_CLAIM_FORMAT = """
local stored = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if stored < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return stored
"""

# KEYS: the model, its deleting mark, the deployment, the deployment index.  ARGV: the
# encoded deployment, its id.  Records the deployment only while the model exists and no
# DeleteModel has marked it, in one step, and returns the model's record (nil when it
# recorded nothing). DeleteModel marks, then looks for deployments: whichever comes
# first wins, and only one of a Deploy and a Delete racing is refused.
_PUT_DEPLOYMENT_OF_MODEL = """
local model = redis.call('GET', KEYS[1])
if not model or redis.call('EXISTS', KEYS[2]) == 1 then return false end
redis.call('SET', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[2])
return model
"""

# How long a node's return after a clean stop is remembered (keys.node_back_after_stop).
BACK_AFTER_STOP_MS = 60_000


class StateStoreUnavailable(Unavailable):
    """Redis, which holds iserve's state, cannot be reached (down, restarting, loading
    its data): UNAVAILABLE, and the call may be retried once it is back."""

    def told_to_tenants(self) -> str:
        # The message names Redis's address (the operator's, in the services' logs).
        return "state store (Redis) unavailable; the call may be retried once it is back"


class StateStoreRefused(StateStoreUnavailable):
    """Redis answers but refuses iserve's commands: its credentials, a permission its
    ACL user lacks, a full memory under ``noeviction``, a read-only replica, a database
    index it does not have. UNAVAILABLE like an unreachable Redis (what iserve writes
    waits, nothing is judged from what it could not write), but with Redis's reason, and
    a process that starts stops at once rather than retrying."""


# What Redis answers a client without the right password. Over a unix socket redis-py's
# asyncio client raises it as a plain ConnectionError, not AuthenticationError, and a
# wrong password there read as "unreachable" after 12 s of retries (a probe).
_AUTH_REFUSALS = (
    "NOAUTH",
    "WRONGPASS",
    "invalid username-password pair",
    "must be called with the client already authenticated",
    "Authentication required",
)


def _auth_refused(exc: Exception) -> bool:
    return isinstance(exc, AuthenticationError) or (
        isinstance(exc, RedisConnectionError) and any(m in str(exc) for m in _AUTH_REFUSALS)
    )


def _refusal_hint(exc: Exception) -> str:
    if _auth_refused(exc):
        return "check the user and password in REDIS_URL"
    if isinstance(exc, NoPermissionError):
        return "its ACL user lacks a permission iserve needs (docs/security.md lists them)"
    if isinstance(exc, OutOfMemoryError):
        return "it is full (maxmemory) and refuses writes"
    if isinstance(exc, ReadOnlyError):
        return "it is a read-only replica: point REDIS_URL at the primary"
    if _cannot_persist(exc):
        return (
            "it cannot save to its disk (a full disk, or a snapshot or AOF write that "
            "failed) and refuses writes until it can: free its disk"
        )
    return "see Redis's message"


def _cannot_persist(exc: Exception) -> bool:
    """Redis's MISCONF: it refuses writes while it cannot save (an AOF or snapshot write
    failed; a full disk). Before, a full disk came back INTERNAL, with a traceback."""
    return isinstance(exc, ResponseError) and str(exc).startswith("MISCONF")


# Redis's refusals of a command that retrying on another connection does not change
# (redis-py raises AuthenticationError as a ConnectionError).
_REFUSALS = (AuthenticationError, NoPermissionError, OutOfMemoryError, ReadOnlyError)


def _refused(exc: Exception) -> bool:
    return (
        isinstance(exc, _REFUSALS)
        or _auth_refused(exc)
        or (isinstance(exc, ResponseError) and str(exc).startswith("DB index is out of range"))
        or _cannot_persist(exc)
    )


def eviction_problem(policy: str | None) -> tuple[str, str]:
    """(why iserve cannot keep its state in a Redis with ``maxmemory-policy`` ``policy``,
    a warning about it): a policy that evicts any key would delete models, deployments
    and reservations once Redis is full (a device's reserved memory then never comes
    back); one that evicts keys with a lifetime may take agents' heartbeats (a node then
    looks dead). None: the policy could not be read (an ACL without INFO)."""
    if policy is None or policy == "noeviction":
        return "", ""
    if policy.startswith("allkeys-"):
        return (
            f"its maxmemory-policy is {policy}: once full it would evict iserve's records "
            "(models, deployments, reservations); set maxmemory-policy noeviction, or use "
            "a Redis of its own for iserve",
            "",
        )
    return "", (
        f"its maxmemory-policy is {policy}: once full it may evict keys with a lifetime, "
        "agents' heartbeats among them (their nodes then look dead); noeviction is safer"
    )


# The format of the records this iserve writes. 2: profiles as binary protobuf
# (``records.encode_compact``), which an iserve of format 1 cannot read. Raise it with
# any change an older iserve would misread, so that it refuses this Redis at start
# instead of failing on a record with a bare parse error.
STATE_FORMAT = 2


class NodeTakenOver(Exception):
    """Another agent process registered this node id since this one last did: it took
    the id over while this one did not answer (a hung or frozen agent)."""

    def __init__(self, node_id: str, holder_address: str):
        super().__init__(
            f"node id {node_id!r} was taken over by the agent at {holder_address or '?'}"
        )
        self.node_id = node_id
        self.holder_address = holder_address


class ReservationError(Exception):
    """A reservation could not be made; ``device`` names the device that refused it."""

    def __init__(self, message: str, device: common.DeviceRef | None = None, free_bytes: int = 0):
        super().__init__(message)
        self.device = device
        self.free_bytes = free_bytes


@dataclass(frozen=True)
class DeviceCounters:
    total_bytes: int
    used_bytes: int
    reserved_bytes: int

    @property
    def free_bytes(self) -> int:
        return free_bytes(self.total_bytes, self.used_bytes, self.reserved_bytes)


def now_ms() -> int:
    return int(time.time() * 1000)


def device_key(ref: common.DeviceRef) -> str:
    return keys.device(ref.node_id, ref.device_id)


def _unavailable_when_redis_is_down(method):
    """``method`` raising StateStoreUnavailable (UNAVAILABLE, naming where Redis should
    be) instead of redis-py's connection and timeout errors."""

    @functools.wraps(method)
    async def call(self: StateStore, *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, ResponseError) as exc:
            if _refused(exc):
                raise StateStoreRefused(
                    f"state store (Redis) at {self.location} refuses iserve's commands "
                    f"({_refusal_hint(exc)}): {exc}"
                ) from exc
            if isinstance(exc, ResponseError):
                raise  # an error of the command itself, not of Redis's state
            if str(exc) == _POOL_EXHAUSTED:
                raise StateStoreUnavailable(
                    f"state store (Redis) at {self.location}: this service's "
                    f"{POOL_CONNECTIONS} connections stayed busy for {POOL_WAIT_S:g} s "
                    "(too many calls at once); try again"
                ) from exc
            raise StateStoreUnavailable(
                f"state store (Redis) unreachable at {self.location}: {exc}"
            ) from exc

    return call


def _translating_redis_errors(cls: type) -> type:
    """Wrap every public coroutine method of ``cls`` with _unavailable_when_redis_is_down."""
    for name, member in list(vars(cls).items()):
        if not name.startswith("_") and name != "close" and inspect.iscoroutinefunction(member):
            setattr(cls, name, _unavailable_when_redis_is_down(member))
    return cls


@_translating_redis_errors
class StateStore:
    """Typed operations on iserve's Redis state; one instance per process. Every call
    raises :class:`StateStoreUnavailable` while Redis cannot be reached;
    redis-py reconnects by itself once it is back."""

    def __init__(self, client: aioredis.Redis):
        self.redis = client
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(_RELEASE)
        self._claim_format = client.register_script(_CLAIM_FORMAT)
        self._put_deployment_of_model = client.register_script(_PUT_DEPLOYMENT_OF_MODEL)

    @classmethod
    def from_url(cls, url: str) -> StateStore:
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=POOL_CONNECTIONS,
            timeout=POOL_WAIT_S,
            decode_responses=True,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=REPLY_TIMEOUT_S,
            # A pooled connection to a Redis that has since restarted fails once
            # ("Connection closed by server"): try again on a new one. Not on a
            # timeout, after which the command may have run.
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.1), RECONNECT_RETRIES),
            retry_on_error=[RedisConnectionError],
        )
        return cls(aioredis.Redis.from_pool(pool))

    @property
    def location(self) -> str:
        """host:port of Redis (or its socket path), for messages."""
        pool = getattr(self.redis, "connection_pool", None)
        options = getattr(pool, "connection_kwargs", {}) or {}
        if "path" in options:
            return str(options["path"])
        return f"{options.get('host', '?')}:{options.get('port', '?')}"

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def wait_until_answering(self, wait_s: float) -> None:
        """Ping until Redis answers, retrying for ``wait_s`` while it starts. Raises
        StateStoreRefused at once (credentials, permissions, a database it does not have:
        no retry changes it), else the last failure once ``wait_s`` has passed."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await self.ping()
                return
            except StateStoreRefused:
                raise
            except Exception:  # noqa: BLE001 - any other failure means "not reachable yet"
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.1)

    async def claim_state_format(self, mine: int = STATE_FORMAT) -> int:
        """Record that records of format ``mine`` are written here, unless a newer one
        was (an iserve of a later version used this Redis): the format stored before,
        0 when none."""
        return int(await self._claim_format(keys=[keys.state_format()], args=[mine]))

    @_unavailable_when_redis_is_down
    async def state_format(self) -> int:
        """The format of the records stored here, 0 when no iserve has claimed it: every
        service claims it at start, so a running stack that reads 0 is on a Redis that
        lost its records (flushed, or an empty one started in its place)."""
        return int(await self.redis.get(keys.state_format()) or 0)

    async def eviction_policy(self) -> str | None:
        """Redis's ``maxmemory-policy`` (``INFO memory``), None where it cannot be read
        (an ACL user without INFO, a managed Redis that hides it)."""
        try:
            info = await self.redis.info("memory")
        except ResponseError:
            return None
        policy = info.get("maxmemory_policy")
        return str(policy) if policy else None

    # ---- models -------------------------------------------------------------------
    async def refuse_a_deployments_id(self, model_id: str) -> None:
        """AlreadyExists when a deployment has ``model_id`` for its id. A deployment's id
        stands where a model's does (the gateway's ``model`` pins a request to it), and
        a model of that id came first there: registered by another tenant, it took the
        deployment's traffic and refused its owner (a probe). The deployer draws an id
        no model has (:meth:`deployment_id_is_free`), so the two never meet."""
        if await self.redis.exists(keys.deployment(model_id)):
            raise AlreadyExists(
                f"model id {model_id!r} is a deployment's id (a deployment's id may stand "
                "where a model's does, so they are never shared); choose another model id"
            )

    async def deployment_id_is_free(self, deployment_id: str) -> bool:
        """Whether neither a deployment nor a model has ``deployment_id`` for its id."""
        return not await self.redis.exists(
            keys.deployment(deployment_id), keys.model(deployment_id)
        )

    async def create_model(self, model: model_pb.Model) -> bool:
        """Record a new model; False when the id is taken (nothing written)."""
        created = await self.redis.set(keys.model(model.model_id), encode(model), nx=True)
        if created:
            await self.redis.sadd(keys.model_index(), model.model_id)
        return bool(created)

    async def put_model(self, model: model_pb.Model) -> None:
        await self.redis.set(keys.model(model.model_id), encode(model))

    async def get_model(self, model_id: str) -> model_pb.Model | None:
        raw = await self.redis.get(keys.model(model_id))
        return None if raw is None else decode(model_pb.Model, raw)

    async def require_model(self, model_id: str) -> model_pb.Model:
        """The registered model ``model_id``; InvalidArgument for a malformed id, NotFound
        when no such model is registered."""
        check_model_id(model_id)
        model = await self.get_model(model_id)
        if model is None:
            raise ModelNotFound(f"model {model_id!r} is not registered")
        return model

    async def list_models(self) -> list[model_pb.Model]:
        ids = sorted(await self.redis.smembers(keys.model_index()))
        return await self._get_many(model_pb.Model, [keys.model(i) for i in ids])

    async def delete_model(self, model_id: str) -> bool:
        """Delete a model's record, profile, progress, sources and configuration maps;
        whether the record existed."""
        maps = [key async for key in self.redis.scan_iter(match=keys.config_maps(model_id))]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(
                keys.model(model_id),
                keys.profile(model_id),
                keys.profile_progress(model_id),
                keys.profile_sources(model_id),
                *maps,
            )
            pipe.srem(keys.model_index(), model_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def mark_model_deleting(self, model_id: str, ttl_s: float) -> None:
        """Mark ``model_id`` as being deleted for at most ``ttl_s`` seconds (so that a
        delete that crashed does not block the model for ever)."""
        await self.redis.set(keys.model_deleting(model_id), now_ms(), px=int(ttl_s * 1000))

    async def clear_model_deleting(self, model_id: str) -> None:
        await self.redis.delete(keys.model_deleting(model_id))

    # ---- profiles and calibrations -------------------------------------------------
    async def put_profile(self, profile: model_pb.GetProfileResponse) -> None:
        """Store a model's raw profiling record (measurements, cost, skipped references),
        in the compact form every estimate reads fast (``records.encode_compact``)."""
        await self.redis.set(keys.profile(profile.model_id), encode_compact(profile))

    async def get_profile(self, model_id: str) -> model_pb.GetProfileResponse | None:
        raw = await self.redis.get(keys.profile(model_id))
        return None if raw is None else decode(model_pb.GetProfileResponse, raw)

    async def put_profile_progress(
        self, model_id: str, progress: model_pb.WatchModelResponse
    ) -> None:
        """Record where a model's profiling stands (read by WatchModel)."""
        await self.redis.set(keys.profile_progress(model_id), encode(progress))

    async def get_profile_progress(self, model_id: str) -> model_pb.WatchModelResponse | None:
        raw = await self.redis.get(keys.profile_progress(model_id))
        return None if raw is None else decode(model_pb.WatchModelResponse, raw)

    async def put_profile_source(self, model_id: str, hardware_type: str, source: str) -> None:
        """Record where ``model_id``'s rows for ``hardware_type`` came from (JSON text)."""
        await self.redis.hset(keys.profile_sources(model_id), hardware_type, source)

    async def get_profile_sources(self, model_id: str) -> dict[str, str]:
        """Hardware type -> the source recorded by :meth:`put_profile_source`."""
        return dict(await self.redis.hgetall(keys.profile_sources(model_id)))

    async def put_config_map(self, model_id: str, hardware_type: str, config_map: str) -> None:
        """Store the estimator's configuration map of a model (JSON text, estimator_svc)."""
        await self.redis.set(keys.config_map(model_id, hardware_type), config_map)

    async def get_config_map(self, model_id: str, hardware_type: str) -> str | None:
        return await self.redis.get(keys.config_map(model_id, hardware_type))

    async def put_calibration(self, calibration: estimator_pb.Calibration) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.calibration(calibration.hardware_type), encode(calibration))
            pipe.sadd(keys.calibration_index(), calibration.hardware_type)
            await pipe.execute()

    async def get_calibration(self, hardware_type: str) -> estimator_pb.Calibration | None:
        raw = await self.redis.get(keys.calibration(hardware_type))
        return None if raw is None else decode(estimator_pb.Calibration, raw)

    async def list_calibrations(self) -> list[estimator_pb.Calibration]:
        names = sorted(await self.redis.smembers(keys.calibration_index()))
        return await self._get_many(estimator_pb.Calibration, [keys.calibration(n) for n in names])

    # ---- deployments --------------------------------------------------------------
    async def put_deployment(self, deployment: deploy_pb.Deployment) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.deployment(deployment.deployment_id), encode(deployment))
            pipe.sadd(keys.deployment_index(), deployment.deployment_id)
            await pipe.execute()

    async def put_deployment_of_model(
        self, deployment: deploy_pb.Deployment
    ) -> model_pb.Model | None:
        """Record a new deployment unless its model is gone or being deleted (marked by
        :meth:`mark_model_deleting`), in one step: the model's record, or None when the
        deployment was not recorded."""
        raw = await self._put_deployment_of_model(
            keys=[
                keys.model(deployment.model_id),
                keys.model_deleting(deployment.model_id),
                keys.deployment(deployment.deployment_id),
                keys.deployment_index(),
            ],
            args=[encode(deployment), deployment.deployment_id],
        )
        return None if raw is None else decode(model_pb.Model, raw)

    async def get_deployment(self, deployment_id: str) -> deploy_pb.Deployment | None:
        raw = await self.redis.get(keys.deployment(deployment_id))
        return None if raw is None else decode(deploy_pb.Deployment, raw)

    async def list_deployments(self, model_id: str = "") -> list[deploy_pb.Deployment]:
        ids = sorted(await self.redis.smembers(keys.deployment_index()))
        found = await self._get_many(deploy_pb.Deployment, [keys.deployment(i) for i in ids])
        return [d for d in found if not model_id or d.model_id == model_id]

    async def delete_deployment(self, deployment: deploy_pb.Deployment) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            groups = {deployment.deployment_id} | {
                replica_group_id(deployment.deployment_id, r.index) for r in deployment.replicas
            }
            pipe.delete(
                keys.deployment(deployment.deployment_id),
                *(keys.workers(group) for group in sorted(groups)),
                keys.deployment_restarts(deployment.deployment_id),
            )
            pipe.srem(keys.deployment_index(), deployment.deployment_id)
            if deployment.request_id:
                pipe.delete(
                    keys.deploy_request(deployment.request_id, deployment.owner),
                    keys.deploy_request_asked(deployment.request_id, deployment.owner),
                )
            await pipe.execute()

    async def get_restarts(self, deployment_id: str) -> str | None:
        """A deployment's restart record (JSON text, ``deploy_svc.healing``), None when
        it never restarted."""
        return await self.redis.get(keys.deployment_restarts(deployment_id))

    async def put_restarts(self, deployment_id: str, record: str) -> None:
        await self.redis.set(keys.deployment_restarts(deployment_id), record)

    async def mark_deployer_stopped(self, now_ms: int) -> None:
        """Record that the deployment service stopped cleanly at ``now_ms``."""
        await self.redis.set(keys.deployer_stopped(), str(now_ms))

    async def take_deployer_stopped(self) -> int | None:
        """When the deployment service last stopped cleanly (ms), clearing it; None when
        its last stop was not clean (a crash) or it never stopped."""
        raw = await self.redis.getdel(keys.deployer_stopped())
        return None if raw is None else int(raw)

    async def claim_deploy_request(
        self, request_id: str, deployment_id: str, asked: str = "", *, owner: str = ""
    ) -> str | None:
        """Bind ``owner``'s ``request_id`` to ``deployment_id`` and what its Deploy
        ``asked``; returns the earlier binding if any. Each owner (token subject) has
        request ids of its own."""
        if await self.redis.set(keys.deploy_request(request_id, owner), deployment_id, nx=True):
            await self.redis.set(keys.deploy_request_asked(request_id, owner), asked)
            return None
        return await self.redis.get(keys.deploy_request(request_id, owner))

    async def deploy_request_asked(self, request_id: str, *, owner: str = "") -> str | None:
        """What the Deploy bound to ``request_id`` asked; None when nothing is bound, or
        the binding predates this record (or is being made)."""
        return await self.redis.get(keys.deploy_request_asked(request_id, owner)) or None

    async def deploy_request(self, request_id: str, *, owner: str = "") -> str | None:
        """The deployment id ``owner``'s ``request_id`` is bound to, if any."""
        return await self.redis.get(keys.deploy_request(request_id, owner))

    async def scope_deploy_requests(self, deployments: list[deploy_pb.Deployment]) -> list[str]:
        """Move the request ids of owned ``deployments`` still under their unscoped keys
        (written before request ids were each owner's own) to their owner's keys, so a
        Deploy retried after an upgrade finds its deployment instead of making another.
        Returns the deployment ids moved; idempotent."""
        moved = []
        for dep in deployments:
            if not (dep.owner and dep.request_id):
                continue
            old = keys.deploy_request(dep.request_id)
            if await self.redis.get(old) != dep.deployment_id:
                continue
            asked = await self.redis.get(keys.deploy_request_asked(dep.request_id))
            new = keys.deploy_request(dep.request_id, dep.owner)
            if await self.redis.set(new, dep.deployment_id, nx=True) and asked is not None:
                await self.redis.set(keys.deploy_request_asked(dep.request_id, dep.owner), asked)
            await self.redis.delete(old, keys.deploy_request_asked(dep.request_id))
            moved.append(dep.deployment_id)
        return moved

    async def forget_deploy_request(self, request_id: str, *, owner: str = "") -> None:
        await self.redis.delete(
            keys.deploy_request(request_id, owner), keys.deploy_request_asked(request_id, owner)
        )

    # ---- nodes and devices --------------------------------------------------------
    async def register_node(
        self, node: common.NodeState, ttl_s: float, holder: str = "", *, take: bool = True
    ) -> None:
        """Record a node's address and devices, replacing what it registered before.

        Atomic: a device the node no longer has leaves its device set and its record is
        deleted, so placement stops seeing it (reservations naming it keep their entry;
        releasing them skips the missing device). A device that joins the set gets its
        ``reserved`` counter from the reservations that still name it.

        ``holder`` names the registering agent process: its first registration
        (``take``) makes it the node's holder; a later one raises NodeTakenOver, writing
        nothing, when another process has registered the node since and still
        heartbeats (one that died since leaves the node to this one again).
        """
        node_id = node.node_id
        static = common.NodeState(node_id=node_id, agent_address=node.agent_address)
        wanted = {dev.ref.device_id for dev in node.devices}
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    # Watched so a concurrent registration or release makes this retry.
                    await pipe.watch(
                        keys.node_devices(node_id),
                        keys.reservation_index(),
                        keys.node_holder(node_id),
                    )
                    if holder and not take:
                        current = await pipe.get(keys.node_holder(node_id))
                        if (
                            current is not None
                            and current != holder
                            and await pipe.exists(keys.node_heartbeat(node_id))
                        ):
                            raw = await pipe.get(keys.node(node_id))
                            address = decode(common.NodeState, raw).agent_address if raw else ""
                            raise NodeTakenOver(node_id, address)
                    registered = set(await pipe.smembers(keys.node_devices(node_id)))
                    stopped = await pipe.get(keys.node_stopped(node_id))
                    joined = wanted - registered
                    reserved = await self._reserved_by_reservations(
                        pipe, [keys.device(node_id, d) for d in joined]
                    )
                    pipe.multi()
                    pipe.set(keys.node(node_id), encode(static))
                    if holder:
                        pipe.set(keys.node_holder(node_id), holder)
                    pipe.sadd(keys.node_index(), node_id)
                    pipe.delete(keys.node_stopped(node_id))
                    if stopped is not None:  # kept through the agent's later registrations
                        pipe.set(keys.node_back_after_stop(node_id), stopped, px=BACK_AFTER_STOP_MS)
                    pipe.set(keys.node_heartbeat(node_id), now_ms(), px=int(ttl_s * 1000))
                    pipe.delete(keys.node_devices(node_id))
                    if wanted:
                        pipe.sadd(keys.node_devices(node_id), *sorted(wanted))
                    for device_id in registered - wanted:
                        pipe.delete(keys.device(node_id, device_id))
                    for dev in node.devices:
                        key = device_key(dev.ref)
                        pipe.hset(key, mapping={"info": encode(dev), "total": dev.total_bytes})
                        if key in reserved:
                            pipe.hset(key, "reserved", reserved[key])
                        else:
                            pipe.hsetnx(key, "reserved", 0)
                    await pipe.execute()
                    return
                except WatchError:
                    continue

    @staticmethod
    async def _reserved_by_reservations(pipe, device_keys: list[str]) -> dict[str, int]:
        """Bytes the recorded reservations hold on each of ``device_keys``."""
        if not device_keys:
            return {}
        totals = dict.fromkeys(device_keys, 0)
        for owner in await pipe.smembers(keys.reservation_index()):
            held = await pipe.hmget(keys.reservation(owner), device_keys)
            for key, amount in zip(device_keys, held, strict=True):
                totals[key] += int(amount or 0)
        return totals

    async def publish_devices(
        self, node_id: str, devices: Iterable[common.DeviceState], ttl_s: float
    ) -> None:
        """Publish measured figures (never ``reserved``, which only reservations change)."""
        stamp = now_ms()
        async with self.redis.pipeline(transaction=False) as pipe:
            for dev in devices:
                pipe.hset(
                    device_key(dev.ref),
                    mapping={
                        "total": dev.total_bytes,
                        "used": dev.used_bytes,
                        "load": repr(dev.load),
                        "updated_ms": stamp,
                    },
                )
            pipe.set(keys.node_heartbeat(node_id), stamp, px=int(ttl_s * 1000))
            await pipe.execute()

    async def list_nodes(self) -> list[common.NodeState]:
        """Every known node with its devices' current figures and liveness."""
        nodes = []
        for node_id in sorted(await self.redis.smembers(keys.node_index())):
            node = await self.get_node(node_id)
            if node is not None:
                nodes.append(node)
        return nodes

    async def get_node(self, node_id: str) -> common.NodeState | None:
        """One node with its devices' current figures and liveness; None if unknown."""
        raw = await self.redis.get(keys.node(node_id))
        if raw is None:
            return None
        node = decode(common.NodeState, raw)
        beat, stopped = await self.redis.mget(
            keys.node_heartbeat(node_id), keys.node_stopped(node_id)
        )
        node.alive = beat is not None
        if stopped is not None and not node.alive:
            node.stopped_at_unix_ms = int(stopped)
        device_ids = sorted(await self.redis.smembers(keys.node_devices(node_id)), key=_natural)
        for device_id in device_ids:
            dev = await self.get_device(common.DeviceRef(node_id=node_id, device_id=device_id))
            if dev is not None:
                node.devices.append(dev)
        # A dead node's last heartbeat is its devices' last update (the heartbeat's key
        # expired with it).
        last = max((d.updated_at_unix_ms for d in node.devices), default=0)
        node.heartbeat_at_unix_ms = int(beat) if beat is not None else last
        return node

    async def mark_node_stopped(self, node_id: str, ttl_s: float) -> None:
        """Record that node ``node_id``'s agent stopped cleanly (its workers with it), and
        end its heartbeat: the deployer takes its replicas elsewhere at once, saying the
        stop was planned, where it waited for the heartbeat to lapse and called it lost.
        The record lasts ``ttl_s`` (or until the node registers again)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.node_stopped(node_id), now_ms(), px=max(1, int(ttl_s * 1000)))
            pipe.delete(keys.node_heartbeat(node_id))
            await pipe.execute()

    async def nodes_back_after_a_stop(self, node_ids: Iterable[str]) -> set[str]:
        """Those of ``node_ids`` whose agents registered again within the last minute
        after a clean stop (``keys.node_back_after_stop``)."""
        node_ids = sorted(set(node_ids))
        if not node_ids:
            return set()
        found = await self.redis.mget([keys.node_back_after_stop(n) for n in node_ids])
        return {n for n, value in zip(node_ids, found, strict=True) if value is not None}

    async def forget_node(self, node_id: str, unseen_since_ms: int) -> bool:
        """Delete the records of node ``node_id`` (its entry, its devices) when it is dead,
        was last seen before ``unseen_since_ms`` and no reservation holds memory on its
        devices; True when it did. An agent of that node that comes back registers it
        again as new. Atomic with registrations, heartbeats and reservations."""
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(
                        keys.node_heartbeat(node_id),
                        keys.node_devices(node_id),
                        keys.reservation_index(),
                        keys.node(node_id),
                    )
                    if await pipe.exists(keys.node_heartbeat(node_id)) or not await pipe.exists(
                        keys.node(node_id)
                    ):
                        return False
                    device_keys = [
                        keys.device(node_id, d)
                        for d in await pipe.smembers(keys.node_devices(node_id))
                    ]
                    if device_keys:
                        await pipe.watch(*device_keys)
                    seen = [int(await pipe.hget(k, "updated_ms") or 0) for k in device_keys]
                    if max(seen, default=0) >= unseen_since_ms:
                        return False
                    held = await self._reserved_by_reservations(pipe, device_keys)
                    if any(held.values()):
                        return False
                    pipe.multi()
                    pipe.srem(keys.node_index(), node_id)
                    pipe.delete(
                        keys.node(node_id),
                        keys.node_devices(node_id),
                        keys.node_stopped(node_id),
                        keys.node_back_after_stop(node_id),
                        keys.node_holder(node_id),
                        *device_keys,
                    )
                    await pipe.execute()
                    return True
                except WatchError:
                    continue

    async def get_device(self, ref: common.DeviceRef) -> common.DeviceState | None:
        fields = await self.redis.hgetall(device_key(ref))
        if "info" not in fields:
            return None
        dev = decode(common.DeviceState, fields["info"])
        counters = DeviceCounters(
            total_bytes=int(fields.get("total", dev.total_bytes)),
            used_bytes=int(fields.get("used", 0)),
            reserved_bytes=max(0, int(fields.get("reserved", 0))),
        )
        dev.total_bytes = counters.total_bytes
        dev.used_bytes = counters.used_bytes
        dev.reserved_bytes = counters.reserved_bytes
        dev.free_bytes = counters.free_bytes
        dev.load = float(fields.get("load", 0.0))
        dev.updated_at_unix_ms = int(fields.get("updated_ms", 0))
        return dev

    # ---- reservations -------------------------------------------------------------
    async def reserve(self, owner: str, need: Mapping[tuple[str, str], int]) -> None:
        """Reserve ``need[(node_id, device_id)]`` bytes on each device for ``owner``,
        all or nothing. Raises ReservationError naming the device that lacks room."""
        if not need:
            raise ValueError("a reservation needs at least one device")
        refs = list(need)
        device_keys = [keys.device(n, d) for n, d in refs]
        amounts = [int(need[r]) for r in refs]
        if any(a < 0 for a in amounts):
            raise ValueError("reservation amounts must be non-negative")
        result = await self._reserve(
            keys=[keys.reservation(owner), keys.reservation_index(), *device_keys],
            args=[owner, *amounts],
        )
        status = int(result[0])
        if status == 1:
            return
        if status == -2:
            raise ReservationError(f"{owner} already holds a reservation")
        node_id, device_id = refs[int(result[1])]
        ref = common.DeviceRef(node_id=node_id, device_id=device_id)
        if status == -1:
            raise ReservationError(f"device {node_id}/{device_id} is unknown", ref)
        free = int(result[2])
        raise ReservationError(
            f"device {node_id}/{device_id} has {free / 2**20:.0f} MiB free, "
            f"{amounts[int(result[1])] / 2**20:.0f} MiB needed",
            ref,
            free,
        )

    async def release(self, owner: str) -> int:
        """Release everything ``owner`` holds (idempotent); returns devices released."""
        return int(
            await self._release(
                keys=[keys.reservation(owner), keys.reservation_index()], args=[owner]
            )
        )

    async def reservation_of(self, owner: str) -> dict[str, int]:
        return {k: int(v) for k, v in (await self.redis.hgetall(keys.reservation(owner))).items()}

    async def reservation_owners(self) -> set[str]:
        return set(await self.redis.smembers(keys.reservation_index()))

    # ---- workers ------------------------------------------------------------------
    async def put_worker(self, info: agent_pb.WorkerInfo, expire_s: float = 0.0) -> None:
        """Record a worker; with ``expire_s``, its group's records expire that long after
        this write."""
        key = keys.workers(info.deployment_id)
        if not expire_s:
            await self.redis.hset(key, str(info.rank), encode(info))
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, str(info.rank), encode(info))
            pipe.expire(key, math.ceil(expire_s))
            await pipe.execute()

    async def list_workers(self, deployment_id: str) -> list[agent_pb.WorkerInfo]:
        raw = await self.redis.hgetall(keys.workers(deployment_id))
        return sorted((decode(agent_pb.WorkerInfo, v) for v in raw.values()), key=lambda w: w.rank)

    async def delete_workers(self, deployment_id: str) -> None:
        await self.redis.delete(keys.workers(deployment_id))

    async def worker_groups(self) -> set[str]:
        """The group ids (deployments, their replicas, profiling jobs) that have worker
        records."""
        return {
            key[len(keys.WORKERS) :] async for key in self.redis.scan_iter(match=f"{keys.WORKERS}*")
        }

    # ---- events -------------------------------------------------------------------
    async def publish_event(self, kind: str, **fields: object) -> str:
        body = {"kind": kind, "at_ms": now_ms(), **fields}
        return await self.redis.xadd(
            keys.events(), {"json": json.dumps(body)}, maxlen=EVENTS_MAXLEN
        )

    async def last_event_id(self) -> str:
        """Id of the newest event, or ``0-0``: read after it to miss nothing from now on."""
        newest = await self.redis.xrevrange(keys.events(), count=1)
        return newest[0][0] if newest else "0-0"

    async def read_events(
        self, after_id: str = "$", block_ms: int = 1000
    ) -> list[tuple[str, dict]]:
        """Events after ``after_id`` (``$``: only new ones), waiting up to ``block_ms``."""
        reply = await self.redis.xread({keys.events(): after_id}, block=block_ms, count=100)
        out = []
        for _stream, entries in reply or []:
            for entry_id, data in entries:
                out.append((entry_id, json.loads(data["json"])))
        return out

    # ---- tokens -------------------------------------------------------------------
    async def put_token(self, info: token_pb.TokenInfo, sha256: str) -> bool:
        """Record a token (its public part and the hash of the whole); False when the id
        is taken (nothing written)."""
        key = keys.token(info.token_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, "info", encode(info))
            pipe.hsetnx(key, "sha256", sha256)
            pipe.sadd(keys.token_index(), info.token_id)
            created, _, _ = await pipe.execute()
        return bool(created)

    async def get_token(self, token_id: str) -> tuple[token_pb.TokenInfo, str] | None:
        if not token_id or ":" in token_id:
            return None
        found = await self.redis.hmget(keys.token(token_id), ["info", "sha256"])
        if found[0] is None or found[1] is None:
            return None
        return decode(token_pb.TokenInfo, found[0]), found[1]

    async def list_tokens(self) -> list[token_pb.TokenInfo]:
        ids = sorted(await self.redis.smembers(keys.token_index()))
        async with self.redis.pipeline(transaction=False) as pipe:
            for token_id in ids:
                pipe.hget(keys.token(token_id), "info")
            found = await pipe.execute()
        return [decode(token_pb.TokenInfo, raw) for raw in found if raw is not None]

    async def delete_token(self, token_id: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.token(token_id))
            pipe.srem(keys.token_index(), token_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    # ---- helpers ------------------------------------------------------------------
    async def _get_many(self, cls, key_list: list[str]):
        if not key_list:
            return []
        values = await self.redis.mget(key_list)
        return [decode(cls, v) for v in values if v is not None]


def _natural(device_id: str) -> tuple[str, int]:
    stem = device_id.rstrip("0123456789")
    digits = device_id[len(stem) :]
    return stem, int(digits) if digits else -1
