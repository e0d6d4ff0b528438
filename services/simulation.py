"""Simulated devices: what ``PlanDeployment`` may be asked to plan on instead of the live
cluster (``iserve plan --hardware HW --devices N``), and the one limit on how many.

The limit keeps a request's planning bounded (a plan scores every node's devices): 4096
devices is 512 nodes of 8, four times the 128-node cluster ``bench/placement_scale.py``
decides on in milliseconds.
"""

from __future__ import annotations

from services.api import common_pb2 as common
from services.ids import is_cpu_hardware

__all__ = ["MAX_SIMULATED_DEVICES", "simulated_devices"]

MAX_SIMULATED_DEVICES = 4096
GIB = float(1 << 30)


def simulated_devices(hardware: str, count: int, memory_gib: float) -> list[common.DeviceState]:
    """``count`` idle devices of ``hardware`` with ``memory_gib`` each (GPU hardware types
    are CUDA devices; ``cpu-…`` ones virtual CPU devices). ValueError beyond
    MAX_SIMULATED_DEVICES."""
    if not 1 <= count <= MAX_SIMULATED_DEVICES:
        raise ValueError(f"simulated devices must number 1 to {MAX_SIMULATED_DEVICES}, got {count}")
    kind = common.DEVICE_KIND_CPU_VIRTUAL if is_cpu_hardware(hardware) else common.DEVICE_KIND_CUDA
    total = int(memory_gib * GIB)
    return [
        common.DeviceState(
            ref=common.DeviceRef(node_id="simulated", device_id=f"dev{i}"),
            kind=kind,
            name=hardware,
            hardware_type=hardware,
            total_bytes=total,
            free_bytes=total,
        )
        for i in range(count)
    ]
