"""Device sampling and what the monitor publishes, without Redis."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from monitor_agent.devices import virtual_devices
from monitor_agent.monitor import DeviceMonitor, DeviceSample, ProcessSampler

DEVICES = virtual_devices(2, 1 << 30, [0], "x86_64")


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_virtual_device_counts_its_workers_memory_and_cpu_time():
    me = os.getpid()
    sampler = ProcessSampler(lambda device_id: [me] if device_id == "cpu0" else [])
    first = sampler.sample(DEVICES)
    assert first["cpu0"].utilisation == 0.0  # no interval yet
    assert first["cpu0"].used_bytes == pytest.approx(psutil.Process().memory_info().rss, rel=0.1)
    assert first["cpu1"] == DeviceSample(0, 0.0)
    _spin(0.2)
    second = sampler.sample(DEVICES)
    assert 0.3 < second["cpu0"].utilisation <= 1.5
    assert second["cpu1"].utilisation == 0.0


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
