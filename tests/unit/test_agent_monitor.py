"""Device sampling and what the monitor publishes, without Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import psutil
import pytest

from monitor_agent import monitor
from monitor_agent.devices import virtual_devices
from monitor_agent.monitor import DeviceMonitor, DeviceSample, ProcessSampler

DEVICES = virtual_devices(2, 1 << 30, [0], "x86_64")


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _cpu_seconds() -> float:
    """This process's CPU time as the sampler reads it (psutil: user + system)."""
    times = psutil.Process().cpu_times()
    return times.user + times.system


def test_a_virtual_device_counts_its_workers_memory_and_cpu_time():
    me = os.getpid()
    sampler = ProcessSampler(lambda device_id: [me] if device_id == "cpu0" else [])
    # Each sample reads the clock, then the CPU time, somewhere between the readings
    # taken just before and just after it.
    wall_a, cpu_a = time.monotonic(), _cpu_seconds()
    first = sampler.sample(DEVICES)
    wall_b, cpu_b = time.monotonic(), _cpu_seconds()
    assert first["cpu0"].utilisation == 0.0  # no interval yet
    assert first["cpu0"].used_bytes == pytest.approx(psutil.Process().memory_info().rss, rel=0.1)
    assert first["cpu1"] == DeviceSample(0, 0.0)
    _spin(0.2)
    wall_c, cpu_c = time.monotonic(), _cpu_seconds()
    second = sampler.sample(DEVICES)
    wall_d, cpu_d = time.monotonic(), _cpu_seconds()
    # Utilisation is the CPU time the workers used over the wall time between the two
    # samples, per core of the device. However busy the machine (which stretches the
    # wall time of the spin), it lies between the least CPU over the most wall time and
    # the most CPU over the least wall time those readings allow.
    cores = len(DEVICES[0].cpu_cores)
    least = (cpu_c - cpu_b) / ((wall_d - wall_a) * cores)
    most = (cpu_d - cpu_a) / ((wall_c - wall_b) * cores)
    assert cpu_c - cpu_b >= 0.15  # the spin used its CPU time (psutil counts 10 ms ticks)
    # At most 1: a spin's clock ticks can read a little above (see the test below).
    assert min(least * 0.99, 1.0) <= second["cpu0"].utilisation <= most * 1.01
    assert second["cpu1"].utilisation == 0.0


_BURN = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"


def _until_idle(process: psutil.Process, quiet_s: float = 0.3) -> None:
    """Return once ``process`` has used no CPU time for ``quiet_s`` seconds."""
    used = sum(process.cpu_times()[:2])
    while True:
        time.sleep(quiet_s)
        now = sum(process.cpu_times()[:2])
        if now == used:
            return
        used = now


def test_utilisation_is_at_most_the_device_s_cores(monkeypatch):
    """CPU time comes in clock ticks: one tick more between two samples a millisecond
    apart read as thousands of per cent (a CI run)."""
    clock = iter([100.0, 100.001])
    monkeypatch.setattr(monitor, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    sampler = ProcessSampler(lambda d: [os.getpid()] if d == "cpu0" else [])
    sampler.sample(DEVICES)
    _spin(0.05)
    assert sampler.sample(DEVICES)["cpu0"].utilisation == 1.0


def test_a_worker_first_seen_counts_all_its_cpu_time():
    """A worker that starts and finishes its work within one interval shows as load: a
    process starts with no CPU time, so all it has was used since the last sample."""
    pids: list[int] = []
    sampler = ProcessSampler(lambda d: pids if d == "cpu0" else [])
    sampler.sample(DEVICES)
    child = psutil.Popen([sys.executable, "-c", _BURN + "input()"], stdin=subprocess.PIPE)
    try:
        while sum(child.cpu_times()[:2]) < 0.3:  # until its burn is done
            time.sleep(0.02)
        _until_idle(child)  # and it waits at input(), on a loaded machine too
        pids.append(child.pid)
        assert sampler.sample(DEVICES)["cpu0"].utilisation > 0.1
        # From then on, only what it uses between samples: it now waits, using none.
        time.sleep(0.2)
        assert sampler.sample(DEVICES)["cpu0"].utilisation < 0.05
    finally:
        child.kill()
        child.wait()


def test_vanished_workers_are_skipped():
    gone = psutil.Popen(["true"])
    gone.wait()
    sampler = ProcessSampler(lambda _device_id: [gone.pid])
    assert sampler.sample(DEVICES)["cpu0"] == DeviceSample(0, 0.0)


class _FixedSampler:
    def __init__(self, utilisation: float):
        self.utilisation = utilisation

    def sample(self, devices):
        return {"cpu0": DeviceSample(123, self.utilisation)}


def test_measure_folds_samples_into_each_devices_load():
    sampler = _FixedSampler(0.5)
    monitor = DeviceMonitor(
        node_id="n0",
        agent_address="127.0.0.1:1",
        devices=DEVICES,
        store=None,
        sampler=sampler,
        heartbeat_ttl_s=5,
        deployments_on=lambda device_id: ["dep"] if device_id == "cpu0" else [],
    )
    for _ in range(12):
        states = monitor.measure()
    cpu0, cpu1 = states
    assert cpu0.ref.node_id == "n0" and cpu0.ref.device_id == "cpu0"
    assert cpu0.used_bytes == 123 and cpu0.load == pytest.approx(12 / 120)
    assert list(cpu0.deployment_ids) == ["dep"]
    assert cpu1.used_bytes == 0 and cpu1.load == 0.0 and not cpu1.deployment_ids
    assert cpu0.total_bytes == 1 << 30


def test_redis_down_is_one_warning_not_a_traceback_every_round(caplog):
    """While Redis is unreachable each round fails; the log says so once, and once more
    when publishing works again (it wrote a 66-line traceback every second)."""
    import asyncio
    import logging

    from services.state.store import StateStoreUnavailable

    class Store:
        def __init__(self):
            self.down = True
            self.rounds = 0

        async def publish_devices(self, *args):
            self.rounds += 1
            if self.down:
                raise StateStoreUnavailable("state store (Redis) unreachable at 127.0.0.1:1")

    store = Store()
    monitor = DeviceMonitor(
        node_id="n0",
        agent_address="127.0.0.1:1",
        devices=DEVICES,
        store=store,
        sampler=_FixedSampler(0.0),
        heartbeat_ttl_s=5,
        deployments_on=lambda device_id: [],
        interval_s=0.001,
    )

    async def register() -> None:
        return None

    monitor.register = register

    async def scenario():
        task = asyncio.create_task(monitor.run())
        while store.rounds < 20:
            await asyncio.sleep(0.001)
        store.down = False
        while store.rounds < 25:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="iserve.agent"):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records]
    failed = [m for m in said if "publishing node n0 failed" in m]
    assert failed == [
        "publishing node n0 failed, retrying each round: "
        "state store (Redis) unreachable at 127.0.0.1:1"
    ]
    assert not any(r.exc_info for r in caplog.records)
    assert said.count("publishing node n0 works again") == 1
