"""Choosing devices and splitting layers, free of gRPC and Redis."""

from __future__ import annotations

from dataclasses import dataclass

from services.api import common_pb2 as common


@dataclass(frozen=True)
class Candidate:
    node_id: str
    device_id: str
    free_bytes: int
    load: float


def candidates(nodes: list[common.NodeState]) -> list[Candidate]:
    """Devices of live nodes."""
    return [
        Candidate(d.ref.node_id, d.ref.device_id, d.free_bytes, d.load)
        for n in nodes
        if n.alive
        for d in n.devices
    ]


def choose_devices(devices: list[Candidate], count: int, need_bytes: int) -> list[Candidate] | None:
    """``count`` distinct devices with ``need_bytes`` free each, packing first: the ones
    with the least free memory that still fit (ties: the most loaded), all on one node
    when any node can hold the whole set. None when no set fits."""
    fitting = [d for d in devices if d.free_bytes >= need_bytes]
    by_node: dict[str, list[Candidate]] = {}
    for d in fitting:
        by_node.setdefault(d.node_id, []).append(d)
    order = sorted(fitting, key=lambda d: (d.free_bytes, -d.load, d.node_id, d.device_id))
    for node_devices in sorted(by_node.values(), key=lambda ds: min(d.free_bytes for d in ds)):
        if len(node_devices) >= count:
            return [d for d in order if d.node_id == node_devices[0].node_id][:count]
    return order[:count] if len(order) >= count else None


def even_layer_map(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """(first_layer, layer_count) per stage; earlier stages take the remainder."""
    if stages < 1 or stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    out, first = [], 0
    for stage in range(stages):
        count = base + (1 if stage < extra else 0)
        out.append((first, count))
        first += count
    return out


def largest_free(devices: list[Candidate]) -> Candidate | None:
    return max(devices, key=lambda d: d.free_bytes, default=None)
