"""Publishes this node's devices to Redis: registration, memory and load every second.

Each round registers the node again (address and device set), so should another agent
have claimed this node id, the agent that still heartbeats is the one the node names.

Virtual CPU device: used bytes are the summed RSS of its live workers; utilisation is
their CPU time over the last interval divided by (interval × the device's cores).
CUDA device: NVML's used memory and ``utilization.gpu``. Either way a second counts busy
when utilisation passes 1 %, and load is busy seconds over the last 120 s / 120.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import psutil

from monitor_agent.devices import DeviceSpec
from monitor_agent.load import LoadRing
from services.api import common_pb2 as common
from services.retry_log import RetryLog
from services.state.store import NodeTakenOver, StateStore, StateStoreUnavailable

log = logging.getLogger("iserve.agent.monitor")

PUBLISH_INTERVAL_S = 1.0
# How long a starting agent waits for the agent that holds its node id to answer.
HOLDER_CHECK_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class DeviceSample:
    used_bytes: int
    # Fraction (0..1) of the last interval the device was busy.
    utilisation: float


class ProcessSampler:
    """Samples virtual CPU devices from their workers' processes (psutil).

    ``pids_on(device_id)`` lists the workers this agent started; a process starts with no
    CPU time, and one first seen was not yet listed at the last sample, so all its CPU
    time counts in the interval it is first seen in. (Counting from its second sample
    on, a small model that loaded and served within one interval never showed as load.)
    """

    def __init__(self, pids_on: Callable[[str], list[int]]):
        self._pids_on = pids_on
        self._processes: dict[int, psutil.Process] = {}
        self._cpu_seconds: dict[int, float] = {}
        self._last_at: float | None = None

    def sample(self, devices: Sequence[DeviceSpec]) -> dict[str, DeviceSample]:
        now = time.monotonic()
        elapsed = None if self._last_at is None else now - self._last_at
        self._last_at = now
        seen: set[int] = set()
        out = {}
        for device in devices:
            rss = 0
            cpu_delta = 0.0
            for pid in self._pids_on(device.device_id):
                measured = self._measure(pid)
                if measured is None:
                    continue
                seen.add(pid)
                pid_rss, cpu_seconds = measured
                rss += pid_rss
                previous = self._cpu_seconds.get(pid, 0.0)
                cpu_delta += max(0.0, cpu_seconds - previous)
                self._cpu_seconds[pid] = cpu_seconds
            capacity = (elapsed or 0.0) * max(1, len(device.cpu_cores))
            # At most 1: CPU time comes in clock ticks, so over a short interval one tick
            # more read as many cores (a CI run: 5,679 % between two samples 1 ms apart).
            busy = min(1.0, cpu_delta / capacity) if capacity else 0.0
            out[device.device_id] = DeviceSample(rss, busy)
        for gone in set(self._processes) - seen:
            self._processes.pop(gone, None)
            self._cpu_seconds.pop(gone, None)
        return out

    def _measure(self, pid: int) -> tuple[int, float] | None:
        try:
            proc = self._processes.get(pid)
            if proc is None:
                proc = self._processes[pid] = psutil.Process(pid)
            with proc.oneshot():
                times = proc.cpu_times()
                return proc.memory_info().rss, times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None


class NvmlSampler:
    """Samples CUDA devices through NVML."""

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml

    def sample(self, devices: Sequence[DeviceSpec]) -> dict[str, DeviceSample]:
        out = {}
        for device in devices:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(device.cuda_index)
            used = int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
            busy_percent = self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            out[device.device_id] = DeviceSample(used, busy_percent / 100.0)
        return out


class DeviceMonitor:
    """Registers the node, then publishes every device's figures each interval."""

    def __init__(
        self,
        *,
        node_id: str,
        agent_address: str,
        devices: Sequence[DeviceSpec],
        store: StateStore,
        sampler: ProcessSampler | NvmlSampler,
        heartbeat_ttl_s: float,
        deployments_on: Callable[[str], list[str]] = lambda _device_id: [],
        interval_s: float = PUBLISH_INTERVAL_S,
        on_measure: Callable[[list[common.DeviceState]], None] = lambda _states: None,
    ):
        self.node_id = node_id
        self.agent_address = agent_address
        self.devices = list(devices)
        self.store = store
        self.sampler = sampler
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.deployments_on = deployments_on
        self.interval_s = interval_s
        # Called with each round's figures (the agent's Prometheus gauges).
        self.on_measure = on_measure
        self.loads = {d.device_id: LoadRing() for d in self.devices}
        # This process's claim on the node id (StateStore.register_node's holder).
        self.holder = secrets.token_hex(8)
        self.registered = False
        # Awaited once when another agent took the node id over (NodeTakenOver): the
        # agent stops; this loop publishes nothing more.
        self.on_taken_over: Callable[[NodeTakenOver], Awaitable[None]] | None = None

    async def register(self) -> None:
        """Register the node; the first registration takes the node id (and says so),
        a later one raises NodeTakenOver when another agent holds it since."""
        node = common.NodeState(
            node_id=self.node_id,
            agent_address=self.agent_address,
            devices=[d.to_state(self.node_id) for d in self.devices],
        )
        first = not self.registered
        await self.store.register_node(node, self.heartbeat_ttl_s, self.holder, take=first)
        self.registered = True
        if first:
            log.info(
                "node %s registered at %s with %d device(s): %s",
                self.node_id,
                self.agent_address,
                len(self.devices),
                ", ".join(f"{d.device_id} ({d.name})" for d in self.devices),
            )

    def measure(self) -> list[common.DeviceState]:
        """One sample of every device, folded into its load ring."""
        samples = self.sampler.sample(self.devices)
        states = []
        for device in self.devices:
            sample = samples.get(device.device_id, DeviceSample(0, 0.0))
            ring = self.loads[device.device_id]
            ring.add(sample.utilisation)
            state = device.to_state(self.node_id)
            state.used_bytes = sample.used_bytes
            state.load = ring.load
            state.deployment_ids.extend(self.deployments_on(device.device_id))
            states.append(state)
        self.on_measure(states)
        return states

    async def run(self) -> None:
        """Background task: every ``interval_s`` until cancelled, register the node and
        publish its devices' figures (a failed round is logged and tried again)."""
        failures = RetryLog(log, f"publishing node {self.node_id}")
        next_at = time.monotonic()
        while True:
            try:
                await self.register()
                await self.store.publish_devices(self.node_id, self.measure(), self.heartbeat_ttl_s)
            except NodeTakenOver as exc:
                # Frozen past the heartbeat, this agent was replaced: two agents under one
                # id took turns as its holder and ran a deployment's rank twice (a probe).
                log.error(
                    "%s while this agent did not answer; it stops its workers and exits, "
                    "leaving the node's records to that agent",
                    exc,
                )
                if self.on_taken_over is not None:
                    await self.on_taken_over(exc)
                return
            except StateStoreUnavailable as exc:
                failures.unavailable(exc)
            except Exception:  # noqa: BLE001 - a Redis hiccup must not stop the heartbeat
                failures.error()
            else:
                failures.succeeded()
            # Keep a steady cadence, but never try to catch up on missed ticks.
            next_at = max(next_at + self.interval_s, time.monotonic())
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def live_holder(
    store: StateStore,
    node_id: str,
    answers: Callable[[str], Awaitable[bool]],
) -> str | None:
    """The address of another live agent that holds ``node_id``, or None when the id
    is free: unregistered, not heartbeating, or held by an agent that does not answer
    ``answers``. Asked before this agent listens: an answer at its own address (gRPC
    lets two servers share a port) is another agent's, and a healthy one was pushed
    off its node that way (a probe); this agent restarting finds none there."""
    node = await store.get_node(node_id)
    if node is None or not node.alive:
        return None
    return node.agent_address if await answers(node.agent_address) else None
