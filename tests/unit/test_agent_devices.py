"""Device discovery: virtual CPU devices and how they split the host's cores."""

from __future__ import annotations

import pytest

from monitor_agent.devices import (
    discover_devices,
    hardware_slug,
    host_cores,
    split_cores,
    virtual_devices,
)
from services.api import common_pb2 as common
from services.settings import GIB, load_settings


def test_fewer_devices_than_cores_get_contiguous_runs():
    assert split_cores(2, [0, 1, 2, 3]) == [(0, 1), (2, 3)]
    assert split_cores(2, [0, 1, 2, 3, 4]) == [(0, 1, 2), (3, 4)]
    assert split_cores(3, range(8)) == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert split_cores(1, [3, 1, 2]) == [(1, 2, 3)]


def test_as_many_devices_as_cores_get_one_core_each():
    assert split_cores(2, [0, 1]) == [(0,), (1,)]


def test_more_devices_than_cores_share_cores_round_robin():
    assert split_cores(4, [0, 1]) == [(0,), (1,), (0,), (1,)]
    assert split_cores(3, [5]) == [(5,), (5,), (5,)]


def test_every_core_is_used_exactly_once_when_devices_are_fewer():
    for devices in range(1, 16):
        split = split_cores(devices, range(16))
        assert sorted(c for cores in split for c in cores) == list(range(16))
        sizes = [len(cores) for cores in split]
        assert max(sizes) - min(sizes) <= 1


def test_split_rejects_nonsense():
    with pytest.raises(ValueError, match="device_count"):
        split_cores(0, [0])
    with pytest.raises(ValueError, match="no CPU cores"):
        split_cores(2, [])


def test_virtual_devices_are_named_sized_and_typed():
    devices = virtual_devices(3, 4 * GIB, [0, 1], "x86_64")
    assert [d.device_id for d in devices] == ["cpu0", "cpu1", "cpu2"]
    assert [d.cpu_cores for d in devices] == [(0,), (1,), (0,)]
    assert all(d.total_bytes == 4 * GIB for d in devices)
    assert all(d.hardware_type == "cpu-x86_64" for d in devices)
    assert all(d.kind == common.DEVICE_KIND_CPU_VIRTUAL and not d.is_cuda for d in devices)
    assert devices[0].torch_device == "cpu"
    assert devices[1].name == "virtual CPU device (cores 1)"


def test_a_device_state_carries_the_static_description():
    device = virtual_devices(1, GIB, [0, 1], "aarch64")[0]
    state = device.to_state("node7")
    assert state.ref.node_id == "node7" and state.ref.device_id == "cpu0"
    assert state.kind == common.DEVICE_KIND_CPU_VIRTUAL
    assert state.hardware_type == "cpu-aarch64"
    assert state.total_bytes == GIB
    assert list(state.cpu_cores) == [0, 1]


def test_gpu_names_become_hardware_types():
    assert hardware_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert hardware_slug("NVIDIA RTX A6000") == "nvidia-rtx-a6000"
    assert hardware_slug("  Tesla V100-SXM2-16GB ") == "tesla-v100-sxm2-16gb"


def test_without_a_gpu_the_node_offers_the_configured_virtual_devices(tmp_path):
    settings = load_settings(
        {
            "ISERVE_STATE_DIR": str(tmp_path),
            "ISERVE_DEVICES": "3",
            "ISERVE_DEVICE_MEMORY_GIB": "1.5",
        }
    )
    devices = discover_devices(settings)
    if devices and devices[0].is_cuda:
        pytest.skip("this host has NVIDIA GPUs")
    assert [d.device_id for d in devices] == ["cpu0", "cpu1", "cpu2"]
    assert all(d.total_bytes == int(1.5 * GIB) for d in devices)
    assert {c for d in devices for c in d.cpu_cores} <= set(host_cores())
