"""The node agent's Prometheus metrics: its devices and its workers.

Updated each time the device monitor publishes (every second), labelled by
``node_id`` and ``device_id``:

- ``iserve_device_memory_total_bytes`` and ``iserve_device_memory_used_bytes`` (measured:
  NVML on GPUs, the workers' resident memory on virtual CPU devices);
- ``iserve_device_load``: busy fraction over the last 120 s (the load placement reads);
- ``iserve_device_workers``: live worker processes on the device;
- ``iserve_workers{node_id, state}``: every worker this agent knows, by state;
- ``iserve_worker_deaths_total{node_id}``: ready workers (ranks) that exited unasked.
  The deployer stops a dead worker's group and restarts or fails it, so the deaths
  left no trace in ``iserve_workers`` (a probe: six SIGKILLs, ``state="failed"`` 0).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.metrics import PREFIX

DEVICE_LABELS = ("node_id", "device_id")


class AgentMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        node_id: str,
        list_workers: Callable[[], list[agent_pb.WorkerInfo]],
        live_pids: Callable[[str], list[int]],
    ):
        self.node_id = node_id
        self._list_workers = list_workers
        self._live_pids = live_pids

        def gauge(name: str, help_text: str, labels: Sequence[str] = DEVICE_LABELS) -> Gauge:
            return Gauge(PREFIX + name, help_text, labels, registry=registry)

        self.total = gauge("device_memory_total_bytes", "Device memory")
        self.used = gauge("device_memory_used_bytes", "Device memory in use, measured")
        self.load = gauge("device_load", "Busy fraction of the device over the last 120 s")
        self.device_workers = gauge("device_workers", "Live worker processes on the device")
        self.workers = gauge("workers", "Workers of this agent by state", ("node_id", "state"))
        self.deaths = Counter(
            PREFIX + "worker_deaths",
            "Ready workers (ranks) of this agent that exited unasked",
            ("node_id",),
            registry=registry,
        )
        self.deaths.labels(node_id)  # 0 from the start: a rate() sees the first death

    def count_deaths(self, count: int) -> None:
        """``count`` ranks were found dead unasked."""
        self.deaths.labels(self.node_id).inc(count)

    def update(self, states: Sequence[common.DeviceState]) -> None:
        """Set every gauge from one round of the device monitor."""
        for state in states:
            labels = (self.node_id, state.ref.device_id)
            self.total.labels(*labels).set(state.total_bytes)
            self.used.labels(*labels).set(state.used_bytes)
            self.load.labels(*labels).set(state.load)
            self.device_workers.labels(*labels).set(len(self._live_pids(state.ref.device_id)))
        by_state = Tally(w.state for w in self._list_workers())
        for name, value in agent_pb.WorkerState.items():
            if value != agent_pb.WORKER_STATE_UNSPECIFIED:
                label = name.removeprefix("WORKER_STATE_").lower()
                self.workers.labels(self.node_id, label).set(by_state.get(value, 0))
