"""Choosing devices and mapping layers for a deployment, free of gRPC and Redis.

``place`` decides where a configuration of ``tp`` tensor-parallel ranks by ``pp`` pipeline
stages runs, and which decoder layers each stage holds (MaverIQ §6: load-aware device
selection and fragmentation-aware layer mapping). See docs/placement.md.

Memory model: a device of a stage that holds ``k`` layers needs
``fixed_bytes + k * layer_bytes`` free, where ``layer_bytes`` is the memory block
``mem_total / (tp * num_layers)`` and ``fixed_bytes`` covers what does not scale with
layers (runtime, embeddings, LM head). A device's *capacity* is the number of layers it
can hold, ``(free_bytes - fixed_bytes) // layer_bytes``; a stage's capacity is the least
capacity among its tp devices.

Rules every placement keeps: the tp devices of a stage are on one node; stages may span
nodes; all tp·pp devices are distinct; layers are split into contiguous ranges, stage by
stage, with at least one layer per stage and no stage above its capacity.

Policies order the devices; the search never enumerates subsets:

* ``packing`` prefers the busiest devices (highest load; equal load: least free memory,
  best fit), so idle and roomy devices stay free for later deployments.
* ``least-loaded`` prefers the idlest devices (lowest load; equal load: most free
  memory), which keeps the average load of the chosen set lowest.
* ``hybrid`` (default) packs like ``packing`` onto devices whose load is below ``theta``;
  when those cannot hold the configuration at all, it chooses like ``least-loaded``
  among every device.

Within the devices a policy considers, a set where every stage fits its even share is
preferred; only when no such set exists are fragments used with an uneven split. Ties
fall to node id, then device id. ``place`` returns None only when no placement exists at
all, whatever the policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.api import common_pb2 as common
from services.engine_rules import even_stage_layers

MIB = 1 << 20
POLICIES = ("hybrid", "packing", "least-loaded")
DEFAULT_THETA = 0.7


@dataclass(frozen=True)
class Candidate:
    node_id: str
    device_id: str
    free_bytes: int
    load: float
    hardware_type: str = ""


@dataclass(frozen=True)
class StageChoice:
    """One pipeline stage: its tp devices in tensor-rank order and its layer range."""

    devices: tuple[Candidate, ...]
    first_layer: int
    layer_count: int
    bytes_per_device: int  # to reserve on each device: fixed_bytes + layer_count * layer_bytes


@dataclass(frozen=True)
class PlacementChoice:
    stages: tuple[StageChoice, ...]
    uneven: bool  # the layer counts differ by more than one: the even split did not fit
    policy: str

    @property
    def devices(self) -> tuple[Candidate, ...]:
        """Every device, stage by stage, in tensor-rank order."""
        return tuple(d for stage in self.stages for d in stage.devices)


def candidates(nodes: list[common.NodeState]) -> list[Candidate]:
    """Devices of live nodes."""
    return [
        Candidate(d.ref.node_id, d.ref.device_id, d.free_bytes, d.load, d.hardware_type)
        for n in nodes
        if n.alive
        for d in n.devices
    ]


def even_layer_map(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """(first_layer, layer_count) per stage; earlier stages take the remainder."""
    out, first = [], 0
    for count in even_stage_layers(num_layers, stages):
        out.append((first, count))
        first += count
    return out


def largest_free(devices: Sequence[Candidate]) -> Candidate | None:
    return max(devices, key=lambda d: d.free_bytes, default=None)


# ---- layer mapping ----------------------------------------------------------------------


def layer_counts(capacities: Sequence[int], num_layers: int) -> tuple[list[int], bool] | None:
    """Layers per stage, in stage order, and whether the split is uneven.

    Even when every stage fits its even share (counts differ by at most one; the extra
    layers go to the earliest stages that can take them, as in ``even_layer_map``);
    otherwise proportional to capacity by largest remainder, each stage between one layer
    and its capacity. None when the stages hold fewer than ``num_layers`` layers."""
    stages = len(capacities)
    caps = [min(c, num_layers) for c in capacities]
    if stages == 0 or stages > num_layers or min(caps) < 1 or sum(caps) < num_layers:
        return None
    base, extra = divmod(num_layers, stages)
    roomy = [i for i, c in enumerate(caps) if c > base]
    if min(caps) >= base and len(roomy) >= extra:
        counts = [base] * stages
        for i in roomy[:extra]:
            counts[i] += 1
        return counts, False
    total = sum(caps)
    counts = [max(1, num_layers * c // total) for c in caps]
    remainder = [num_layers * c % total for c in caps]
    missing = num_layers - sum(counts)
    # Largest remainders first when layers are missing; smallest first when the floor of
    # one layer per stage gave out too many. Capacities sum to num_layers or more and
    # num_layers >= stages, so both loops end.
    grow = sorted(range(stages), key=lambda i: (-remainder[i], i))
    while missing > 0:
        for i in grow:
            if missing and counts[i] < caps[i]:
                counts[i] += 1
                missing -= 1
    shrink = sorted(range(stages), key=lambda i: (remainder[i], i))
    while missing < 0:
        for i in shrink:
            if missing and counts[i] > 1:
                counts[i] -= 1
                missing += 1
    return counts, True


# ---- device selection -------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """tp devices of one node that could form a stage."""

    devices: tuple[Candidate, ...]
    capacity: int  # layers each of its devices can hold
    key: tuple  # the policy's preference: smaller first


@dataclass(frozen=True)
class _Order:
    device_key: Callable[[Candidate], tuple]
    group_key: Callable[[tuple[Candidate, ...]], tuple]


def _packing_group_key(devices: tuple[Candidate, ...]) -> tuple:
    load = sum(d.load for d in devices) / len(devices)
    return (-load, sum(d.free_bytes for d in devices), devices[0].node_id, devices[0].device_id)


def _spreading_group_key(devices: tuple[Candidate, ...]) -> tuple:
    load = sum(d.load for d in devices) / len(devices)
    return (load, -sum(d.free_bytes for d in devices), devices[0].node_id, devices[0].device_id)


_PACKING = _Order(
    device_key=lambda d: (-d.load, d.free_bytes, d.node_id, d.device_id),
    group_key=_packing_group_key,
)
_SPREADING = _Order(
    device_key=lambda d: (d.load, -d.free_bytes, d.node_id, d.device_id),
    group_key=_spreading_group_key,
)


def _groups(
    ordered: list[tuple[Candidate, int]], tp: int, min_capacity: int, order: _Order
) -> list[_Group]:
    """Consecutive runs of tp devices per node, in the given device order, keeping only
    devices that hold ``min_capacity`` layers; sorted by the policy's group preference."""
    by_node: dict[str, list[tuple[Candidate, int]]] = {}
    for device, capacity in ordered:
        if capacity >= min_capacity:
            by_node.setdefault(device.node_id, []).append((device, capacity))
    groups = []
    for members in by_node.values():
        for start in range(0, len(members) - tp + 1, tp):
            run = members[start : start + tp]
            devices = tuple(d for d, _ in run)
            groups.append(_Group(devices, min(c for _, c in run), order.group_key(devices)))
    groups.sort(key=lambda g: g.key)
    return groups


def _pick_even(groups: list[_Group], pp: int, base: int, extra: int) -> list[_Group] | None:
    """The most preferred pp groups where ``extra`` stages hold base + 1 layers and the
    rest base (groups hold at least base already)."""
    roomy, plain, chosen = 0, 0, []
    for g in groups:
        if g.capacity > base and roomy < extra:
            roomy += 1
        elif plain < pp - extra:
            plain += 1
        else:
            continue
        chosen.append(g)
        if len(chosen) == pp:
            return chosen
    return None


def _pick_by_capacity(groups: list[_Group], pp: int, num_layers: int) -> list[_Group] | None:
    """The most preferred pp groups, then swapped for roomier ones until together they
    hold ``num_layers``: each swap drops the chosen group with the least capacity for the
    most preferred group that closes the gap, else for the roomiest group left. Ends
    within pp + 1 swaps; None when even the pp roomiest groups are too small."""
    if len(groups) < pp:
        return None
    chosen, rest = groups[:pp], groups[pp:]
    total = sum(g.capacity for g in chosen)
    while total < num_layers:
        victim = min(range(pp), key=lambda i: (chosen[i].capacity, -i))
        needed = chosen[victim].capacity + num_layers - total
        pick = next((j for j, g in enumerate(rest) if g.capacity >= needed), None)
        if pick is None:
            pick = max(range(len(rest)), key=lambda j: (rest[j].capacity, -j), default=None)
            if pick is None or rest[pick].capacity <= chosen[victim].capacity:
                return None
        total += rest[pick].capacity - chosen[victim].capacity
        chosen[victim], rest[pick] = rest[pick], chosen[victim]
    return chosen


def _capacity(free_bytes: int, fixed_bytes: int, layer_bytes: int, num_layers: int) -> int:
    room = free_bytes - fixed_bytes
    if room < 0:
        return 0
    if layer_bytes == 0:
        return num_layers
    return min(num_layers, room // layer_bytes)


def _choose_in(
    devices: list[tuple[Candidate, int]], order: _Order, tp: int, pp: int, num_layers: int
) -> list[_Group] | None:
    """Stage groups among ``devices`` (with their capacities) in the order's preference:
    an even fit first, then any fit. None only when these devices cannot hold the model."""
    ordered = sorted(devices, key=lambda dc: order.device_key(dc[0]))
    # Runs of tp in capacity order give each node its roomiest possible stages, so the
    # second try of each kind fails only when no choice of these devices fits that way.
    roomiest = sorted(ordered, key=lambda dc: -dc[1])
    layouts = (ordered,) if tp == 1 else (ordered, roomiest)
    base, extra = divmod(num_layers, pp)
    for runs in layouts:
        chosen = _pick_even(_groups(runs, tp, base, order), pp, base, extra)
        if chosen is not None:
            return chosen
    for runs in layouts:
        chosen = _pick_by_capacity(_groups(runs, tp, 1, order), pp, num_layers)
        if chosen is not None:
            return chosen
    return None


def _validate(
    devices: Sequence[Candidate], tp: int, pp: int, num_layers: int, fixed: int, layer: int
) -> None:
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be at least 1, got tp={tp} pp={pp}")
    if pp > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {pp} pipeline stages")
    if fixed < 0 or layer < 0:
        raise ValueError(f"byte counts must not be negative: fixed={fixed} per layer={layer}")
    if len({(d.node_id, d.device_id) for d in devices}) != len(devices):
        raise ValueError("a device is listed twice")


def place(
    devices: Sequence[Candidate],
    *,
    tp: int,
    pp: int,
    num_layers: int,
    fixed_bytes: int,
    layer_bytes: int,
    policy: str = "hybrid",
    theta: float = DEFAULT_THETA,
) -> PlacementChoice | None:
    """Devices and layer ranges for ``tp`` x ``pp`` ranks of a ``num_layers`` model.

    Each device of a stage holding k layers gets ``fixed_bytes + k * layer_bytes``
    (bytes). ``policy`` is one of ``POLICIES``:

    * ``"packing"``: among devices with room, the busiest (load descending, then least
      free memory, then node id, device id) form the stages.
    * ``"least-loaded"``: the idlest (load ascending, then most free memory, then ids).
    * ``"hybrid"``: ``"packing"`` restricted to devices with load < ``theta``; if those
      cannot hold the model at all, ``"least-loaded"`` over every device.

    Stages are runs of tp devices of one node in that order; a stage's preference is its
    devices' mean load (then total free memory). Devices where every stage fits its even
    share come first; failing that, the preferred stages are swapped for roomier ones
    until they hold every layer, and layers are split in proportion to capacity. Stages
    are ordered by node id then device id, so stages on one node are neighbours.

    Returns None only when no placement exists; ``explain_no_fit`` says why. Raises
    ValueError for tp or pp below 1, pp above num_layers, negative byte counts, an
    unknown policy, theta outside [0, 1] or a device listed twice.
    """
    _validate(devices, tp, pp, num_layers, fixed_bytes, layer_bytes)
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; one of {', '.join(POLICIES)}")
    if not 0.0 <= theta <= 1.0:
        raise ValueError(f"theta must be within [0, 1], got {theta}")
    if len(devices) < tp * pp:
        return None
    usable = [
        (d, c)
        for d in devices
        if (c := _capacity(d.free_bytes, fixed_bytes, layer_bytes, num_layers)) >= 1
    ]
    if len(usable) < tp * pp or pp * max(c for _, c in usable) < num_layers:
        # No stage holds more than the roomiest device: a bound in one pass, where the
        # search below builds the node-local groups four times (a plan on 4096 devices
        # took 17 s, most of it proving that configurations did not fit).
        return None
    if policy == "hybrid":
        packable = [(d, c) for d, c in usable if d.load < theta]
        tiers = [(packable, _PACKING)]
        if len(packable) < len(usable):
            tiers.append((usable, _SPREADING))
    else:
        tiers = [(usable, _PACKING if policy == "packing" else _SPREADING)]
    for tier, order in tiers:
        chosen = _choose_in(tier, order, tp, pp, num_layers)
        if chosen is not None:
            return _build(chosen, num_layers, fixed_bytes, layer_bytes, policy)
    return None


def _build(
    groups: list[_Group], num_layers: int, fixed_bytes: int, layer_bytes: int, policy: str
) -> PlacementChoice:
    groups = sorted(
        groups, key=lambda g: (g.devices[0].node_id, min(d.device_id for d in g.devices))
    )
    mapped = layer_counts([g.capacity for g in groups], num_layers)
    assert mapped is not None, "chosen stages always hold the model"
    counts, uneven = mapped
    stages, first = [], 0
    for g, count in zip(groups, counts, strict=True):
        ranks = tuple(sorted(g.devices, key=lambda d: d.device_id))
        stages.append(StageChoice(ranks, first, count, fixed_bytes + count * layer_bytes))
        first += count
    return PlacementChoice(tuple(stages), uneven, policy)


def explain_no_fit(
    devices: Sequence[Candidate],
    *,
    tp: int,
    pp: int,
    num_layers: int,
    fixed_bytes: int,
    layer_bytes: int,
) -> str:
    """One line saying why ``place`` finds nothing for these arguments (the reason does
    not depend on the policy: every policy falls back to any placement that exists)."""
    _validate(devices, tp, pp, num_layers, fixed_bytes, layer_bytes)
    count = tp * pp
    biggest = largest_free(devices)
    if biggest is None:
        return "no live devices"
    largest = (
        f"largest free: {biggest.free_bytes / MIB:.0f} MiB on {biggest.node_id}/{biggest.device_id}"
    )
    if len(devices) < count:
        return f"tp={tp} x pp={pp} needs {count} devices, the cluster has {len(devices)}"
    one_layer = fixed_bytes + layer_bytes
    usable = [
        (d, c)
        for d in devices
        if (c := _capacity(d.free_bytes, fixed_bytes, layer_bytes, num_layers)) >= 1
    ]
    roomiest = sorted(usable, key=lambda dc: (-dc[1], _SPREADING.device_key(dc[0])))
    groups = sorted(_groups(roomiest, tp, 1, _SPREADING), key=lambda g: -g.capacity)
    if len(groups) < pp:
        what = "device(s)" if tp == 1 else f"node-local group(s) of {tp} devices"
        return (
            f"only {len(groups)} {what} have {one_layer / MIB:.0f} MiB free each (runtime plus "
            f"one layer); {pp} pipeline stage(s) need one each ({largest})"
        )
    held = sum(g.capacity for g in groups[:pp])
    if held < num_layers:
        share = max(even_stage_layers(num_layers, pp))
        return (
            f"the {pp} roomiest stage(s) of {tp} device(s) hold {held} of {num_layers} layers "
            f"at {fixed_bytes / MIB:.0f} MiB + {layer_bytes / MIB:.0f} MiB per layer per device "
            f"(an even split needs {(fixed_bytes + share * layer_bytes) / MIB:.0f} MiB per device; "
            f"{largest})"
        )
    return f"a placement of tp={tp} x pp={pp} fits"
