"""The node agent process: devices, monitor, supervisor and AgentService wired together.

Environment (see ``services.settings``): ``REDIS_URL`` (required), ``ISERVE_NODE_ID``,
``ISERVE_AGENT_ADDR`` (where AgentService listens and what the node advertises),
``ISERVE_HOST`` (interface workers bind to), ``ISERVE_STATE_DIR`` (worker logs and ready
files), ``ISERVE_MODELS_ROOT``, ``ISERVE_DEVICES`` / ``ISERVE_DEVICE_MEMORY_GIB``
(virtual CPU devices when no GPU is found), ``ISERVE_HEARTBEAT_TTL_S``,
``ISERVE_READY_TIMEOUT_S``, ``ISERVE_DRAIN_TIMEOUT_S`` (how long a stopped worker may
finish its generations). This process never imports torch; workers do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

from monitor_agent.devices import discover_devices
from monitor_agent.metrics import AgentMetrics
from monitor_agent.monitor import (
    HOLDER_CHECK_TIMEOUT_S,
    DeviceMonitor,
    NvmlSampler,
    ProcessSampler,
    live_holder,
)
from monitor_agent.servicer import AgentServicer
from monitor_agent.shm_files import remove_orphaned_shared_files
from monitor_agent.supervisor import WorkerSupervisor
from monitor_agent.worker_pool import WorkerPool
from services import health
from services.api import agent_service_pb2_grpc
from services.grpc_server import ServiceBinding
from services.metrics import new_registry
from services.ports import free_port
from services.service_main import ServiceParts, fail, serve_service
from services.settings import SERVICE_ENV, WILDCARD_HOSTS, Settings, is_loopback_host
from services.state.store import NodeTakenOver, StateStore

log = logging.getLogger("iserve.agent")
# How long the record of a clean stop lasts when dead nodes are never forgotten.
STOPPED_RECORD_S = 86_400.0


def advertised_host(bind_host: str) -> str:
    """The host other processes use to reach a server bound to ``bind_host``."""
    return socket.gethostname() if bind_host in WILDCARD_HOSTS else bind_host


def advertised_address(address: str) -> str:
    """``host:port`` as other processes reach it: a wildcard host (``0.0.0.0:7000``,
    what an agent listening on every interface is given) becomes this machine's name, as
    for the workers (:func:`advertised_host`); a wildcard means "here" to whoever dials
    it, and a deployer or a remote rank on another host would dial itself."""
    host, sep, port = address.rpartition(":")
    return f"{advertised_host(host)}:{port}" if sep and host in WILDCARD_HOSTS else address


def _resolves_to_loopback(name: str) -> bool:
    """Whether every address ``name`` resolves to is a loopback one (False when it does
    not resolve: that is reported where it is dialled)."""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return False
    return bool(found) and all(is_loopback_host(address) for address in found)


async def answers_health(address: str) -> bool:
    """True when an agent at ``address`` answers its health check within
    HOLDER_CHECK_TIMEOUT_S."""
    return await asyncio.to_thread(health.check, address, HOLDER_CHECK_TIMEOUT_S)


def build_agent(settings: Settings, store: StateStore) -> ServiceParts:
    devices = discover_devices(settings)
    pool = None
    if settings.worker_pool:
        pool = WorkerPool()
        pool.start()
    supervisor = WorkerSupervisor(
        node_id=settings.node_id,
        store=store,
        state_dir=settings.state_dir,
        bind_host=settings.host,
        advertise_host=advertised_host(settings.host),
        drain_timeout_s=settings.drain_timeout_s,
        pool=pool,
        worker_ports=settings.worker_ports,
    )
    sampler = (
        NvmlSampler() if any(d.is_cuda for d in devices) else ProcessSampler(supervisor.live_pids)
    )
    for path in [*remove_orphaned_shared_files(), *supervisor.remove_stale_ready_files()]:
        log.info("removed %s, left by a worker that is gone", path)
    registry = new_registry()
    metrics = AgentMetrics(
        registry, settings.node_id, supervisor.list_workers, supervisor.live_pids
    )
    supervisor.on_deaths = metrics.count_deaths
    agent_address = advertised_address(settings.address("agent"))
    if not is_loopback_host(agent_address.rpartition(":")[0]) and is_loopback_host(settings.host):
        log.warning(
            "this agent is reached at %s but its workers bind %s (ISERVE_HOST): other "
            "hosts cannot reach them; set ISERVE_HOST to this host's address",
            agent_address,
            settings.host,
        )
    if settings.host in WILDCARD_HOSTS and _resolves_to_loopback(advertised_host(settings.host)):
        # Workers bound everywhere are advertised by this host's name; most hosts map it
        # to a loopback address, and the scheduler on another host then dialled itself.
        log.warning(
            "ISERVE_HOST=%s: this agent's workers are advertised as %r, which resolves to "
            "a loopback address here: processes on other hosts cannot reach them; set "
            "ISERVE_HOST to this host's address on the cluster's network",
            settings.host,
            advertised_host(settings.host),
        )
    monitor = DeviceMonitor(
        node_id=settings.node_id,
        agent_address=agent_address,
        devices=devices,
        store=store,
        sampler=sampler,
        heartbeat_ttl_s=settings.heartbeat_ttl_s,
        deployments_on=supervisor.deployments_on,
        on_measure=metrics.update,
    )

    async def refuse_a_node_id_in_use() -> None:
        holder = await live_holder(store, settings.node_id, answers_health)
        if holder is not None:
            fail(
                f"node id {settings.node_id!r} is held by a live agent at {holder}; "
                "stop that agent or give this one another ISERVE_NODE_ID"
            )

    taken_over = asyncio.Event()

    async def give_up_the_node(_exc: NodeTakenOver) -> None:
        """Another agent took this node id over while this one was frozen: stop its own
        workers (orphans otherwise, each a deployment's rank run twice) and exit, writing
        nothing under the node id that agent now holds."""
        supervisor.disown()
        taken_over.set()
        os.kill(os.getpid(), signal.SIGTERM)  # the agent's own graceful stop

    monitor.on_taken_over = give_up_the_node

    async def stop() -> None:
        """Stop every worker, and the warm pool."""
        await supervisor.stop_all()
        if pool is not None:  # gone before the agent: `iserve down` waits for the agent
            await asyncio.to_thread(pool.stop)

    async def record_the_stop() -> None:
        """Say in Redis that this node stops on purpose, its heartbeat (the monitor's
        task) already cancelled, before any worker drains: the deployer moves its
        replicas at once and says why. Recorded after the workers' stop, under traffic a
        draining worker reached the deployer first, through the scheduler, while this
        agent no longer answered: "do not answer", a lost node (a probe). Not when
        another agent holds the node now: its stop is not this one's."""
        if taken_over.is_set():
            return
        try:
            await store.mark_node_stopped(
                settings.node_id, settings.node_forget_after_s or STOPPED_RECORD_S
            )
        except Exception as exc:  # noqa: BLE001 - Redis down: the heartbeat lapses instead
            log.warning("could not record this node's stop in Redis: %s", exc)

    servicer = AgentServicer(settings, devices, supervisor)
    binding = ServiceBinding(
        servicer,
        agent_service_pb2_grpc.add_AgentServiceServicer_to_server,
        "iserve.v1.AgentService",
    )
    return ServiceParts(
        bindings=[binding],
        on_start=refuse_a_node_id_in_use,
        background=[monitor.run, supervisor.reap_forever],
        on_stop=stop,
        before_stop=record_the_stop,
        registry=registry,
    )


def pin_any_port(env: dict[str, str] | os._Environ) -> None:
    """Replace port 0 in ISERVE_AGENT_ADDR by a free port, so the address the node
    advertises is the one the agent listens on (the kernel's pick is known only after
    binding, too late for the registration)."""
    name = SERVICE_ENV["agent"]
    host, sep, port = env.get(name, "").rpartition(":")
    if sep and port == "0":
        env[name] = f"{host}:{free_port(host.strip('[]') or '127.0.0.1')}"


def main() -> int:
    pin_any_port(os.environ)
    serve_service("agent", build_agent)
    return 0
