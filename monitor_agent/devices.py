"""The devices this node offers: NVIDIA GPUs when NVML finds any, else virtual CPU devices.

A virtual CPU device is a memory budget plus a share of the host's cores; a worker placed
on it pins its threads to those cores, so two workers on two devices really run side by
side. The pure helpers (``split_cores``, ``virtual_devices``, ``hardware_slug``) take
everything as arguments so tests can drive them without touching the host.
"""

from __future__ import annotations

import logging
import os
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass

from services.api import common_pb2 as common
from services.ids import cpu_hardware_type
from services.settings import Settings

log = logging.getLogger("iserve.agent.devices")


@dataclass(frozen=True)
class DeviceSpec:
    """One device as the agent sees it; static for the agent's lifetime."""

    device_id: str
    kind: int  # common.DeviceKind value
    name: str
    hardware_type: str
    total_bytes: int
    # Cores a worker on this device pins its threads to.
    cpu_cores: tuple[int, ...]
    # NVML / CUDA index; None for virtual CPU devices.
    cuda_index: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.kind == common.DEVICE_KIND_CUDA

    @property
    def torch_device(self) -> str:
        """The device string a worker passes to torch: ``cpu`` or ``cuda:<index>``."""
        return f"cuda:{self.cuda_index}" if self.cuda_index is not None else "cpu"

    def to_state(self, node_id: str) -> common.DeviceState:
        return common.DeviceState(
            ref=common.DeviceRef(node_id=node_id, device_id=self.device_id),
            kind=self.kind,
            name=self.name,
            hardware_type=self.hardware_type,
            total_bytes=self.total_bytes,
            cpu_cores=list(self.cpu_cores),
        )


def split_cores(device_count: int, cores: Sequence[int]) -> list[tuple[int, ...]]:
    """Cores of each of ``device_count`` devices.

    With at least as many devices as cores, device i gets core ``cores[i % len(cores)]``
    (devices share cores); otherwise the cores are split into contiguous runs whose sizes
    differ by at most one, the first devices taking the larger runs.
    """
    if device_count <= 0:
        raise ValueError(f"device_count must be positive, got {device_count}")
    if not cores:
        raise ValueError("no CPU cores to split")
    ordered = sorted(cores)
    if device_count >= len(ordered):
        return [(ordered[i % len(ordered)],) for i in range(device_count)]
    base, extra = divmod(len(ordered), device_count)
    out, start = [], 0
    for i in range(device_count):
        size = base + (1 if i < extra else 0)
        out.append(tuple(ordered[start : start + size]))
        start += size
    return out


def virtual_devices(
    count: int, memory_bytes: int, cores: Sequence[int], machine: str
) -> list[DeviceSpec]:
    """``count`` virtual CPU devices "cpu0".."cpu{count-1}" with ``memory_bytes`` each."""
    hardware_type = cpu_hardware_type(machine)
    devices = []
    for i, device_cores in enumerate(split_cores(count, cores)):
        shown = ",".join(str(c) for c in device_cores)
        devices.append(
            DeviceSpec(
                device_id=f"cpu{i}",
                kind=common.DEVICE_KIND_CPU_VIRTUAL,
                name=f"virtual CPU device (cores {shown})",
                hardware_type=hardware_type,
                total_bytes=memory_bytes,
                cpu_cores=device_cores,
            )
        )
    return devices


def hardware_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def host_cores() -> list[int]:
    """Cores this process may run on (its affinity mask, which containers narrow)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cuda_devices(cores: Sequence[int]) -> list[DeviceSpec]:
    """NVIDIA GPUs through NVML; empty when pynvml is missing or finds no GPU."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        log.info("NVML unavailable (%s); using virtual CPU devices", exc)
        return []
    if count == 0:
        return []
    devices = []
    for i, device_cores in enumerate(split_cores(count, cores)):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        devices.append(
            DeviceSpec(
                device_id=f"cuda{i}",
                kind=common.DEVICE_KIND_CUDA,
                name=name,
                hardware_type=hardware_slug(name),
                total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                cpu_cores=device_cores,
                cuda_index=i,
            )
        )
    return devices


def discover_devices(settings: Settings) -> list[DeviceSpec]:
    """The node's GPUs, or ``settings.virtual_devices`` virtual CPU devices without any."""
    cores = host_cores()
    found = cuda_devices(cores)
    if found:
        return found
    return virtual_devices(
        settings.virtual_devices, settings.device_memory_bytes, cores, platform.machine()
    )
