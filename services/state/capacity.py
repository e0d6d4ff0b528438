"""A device's free memory: the one rule, in Python and in the Lua that reserves; and
the memory a hardware type's configurations are judged by (:func:`largest_device_bytes`).

Free bytes are the total less the larger of what is measured in use and what is
reserved: a reservation holds room before its workers have allocated it, and memory used
beyond any reservation (another process, a worker still exiting) is not free either.
The reserve script (``services.state.store``) embeds :data:`FREE_BYTES_LUA`;
``tests/unit/test_state_store.py`` runs both on the same counters and checks they agree.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.api import common_pb2 as common

__all__ = ["FREE_BYTES_LUA", "free_bytes", "largest_device_bytes"]

# Lua expression over the numbers total, used and reserved (the reserve script's locals).
FREE_BYTES_LUA = "math.max(0, total - math.max(used, reserved))"


def free_bytes(total: int, used: int, reserved: int) -> int:
    """Bytes of a device that are neither in use nor reserved."""
    return max(0, total - max(used, reserved))


def largest_device_bytes(nodes: Sequence[common.NodeState], hardware_type: str) -> int:
    """Total bytes of the largest live device of ``hardware_type`` among ``nodes`` (live
    or simulated; 0 when there is none): what a configuration must fit on a device to be
    placeable at all. One that fits only the larger devices is placed on them: the
    deployer walks the ranking until a configuration places. Judged by the smallest
    device, one small device beside large ones ruled out what the large ones hold."""
    return max(
        (
            d.total_bytes
            for n in nodes
            if n.alive
            for d in n.devices
            if d.hardware_type == hardware_type
        ),
        default=0,
    )
