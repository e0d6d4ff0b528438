"""Placement: stage groups per node, policies, even and fragmentation-aware layer maps."""

from __future__ import annotations

import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy_svc.placement import (
    POLICIES,
    Candidate,
    PlacementChoice,
    even_layer_map,
    explain_no_fit,
    layer_counts,
    place,
)

GIB = 1 << 30
# With one GiB fixed and one GiB per layer a device with f GiB free holds f - 1 layers.
FIXED = GIB
LAYER = GIB


def _dev(node: str, dev: str, free_gib: float, load: float = 0.0) -> Candidate:
    return Candidate(node, dev, int(free_gib * GIB), load)


def _place(devices, *, tp=1, pp=1, layers=8, fixed=FIXED, layer=LAYER, **kw):
    return place(
        devices, tp=tp, pp=pp, num_layers=layers, fixed_bytes=fixed, layer_bytes=layer, **kw
    )


def _ids(choice: PlacementChoice) -> list[str]:
    return [f"{d.node_id}/{d.device_id}" for d in choice.devices]


def _counts(choice: PlacementChoice) -> list[int]:
    return [s.layer_count for s in choice.stages]


def _assert_valid(choice, devices, *, tp, pp, layers, fixed=FIXED, layer=LAYER):
    """Every rule a placement must keep."""
    assert len(choice.stages) == pp
    free = {(d.node_id, d.device_id): d.free_bytes for d in devices}
    chosen = [(d.node_id, d.device_id) for d in choice.devices]
    assert len(chosen) == tp * pp and len(set(chosen)) == tp * pp
    first = 0
    for stage in choice.stages:
        assert len(stage.devices) == tp
        assert len({d.node_id for d in stage.devices}) == 1, "tp devices share a node"
        assert stage.first_layer == first and stage.layer_count >= 1
        assert stage.bytes_per_device == fixed + stage.layer_count * layer
        for d in stage.devices:
            assert stage.bytes_per_device <= free[(d.node_id, d.device_id)]
        first += stage.layer_count
    assert first == layers
    counts = _counts(choice)
    assert choice.uneven == (max(counts) - min(counts) > 1)


# ---- layer mapping ----------------------------------------------------------------------


def test_even_split_when_every_stage_fits():
    devices = [_dev("a", str(i), 20) for i in range(4)]
    choice = _place(devices, pp=4, layers=30)
    assert not choice.uneven
    assert [(s.first_layer, s.layer_count) for s in choice.stages] == even_layer_map(30, 4)
    assert [s.bytes_per_device for s in choice.stages] == [9 * GIB, 9 * GIB, 8 * GIB, 8 * GIB]


def test_uneven_split_follows_capacity_when_memory_is_fragmented():
    # 12 layers over devices holding 3 and 10 layers: 6 + 6 does not fit.
    devices = [_dev("a", "0", 4), _dev("a", "1", 11)]
    choice = _place(devices, pp=2, layers=12)
    assert choice.uneven
    assert [(s.first_layer, s.layer_count) for s in choice.stages] == [(0, 3), (3, 9)]
    _assert_valid(choice, devices, tp=1, pp=2, layers=12)


def test_extra_layers_go_to_the_stages_that_can_take_them():
    # 9 layers on 2 stages: 5 + 4, and only the second device holds 5.
    devices = [_dev("a", "0", 5), _dev("a", "1", 6)]
    choice = _place(devices, pp=2, layers=9)
    assert not choice.uneven and _counts(choice) == [4, 5]


def test_none_when_the_stages_cannot_hold_every_layer():
    devices = [_dev("a", "0", 4), _dev("a", "1", 11)]
    assert _place(devices, pp=2, layers=14) is None
    assert _place(devices, pp=3, layers=6) is None  # three stages, two devices
    assert _place([_dev("a", "0", 1.5)], layers=1) is None  # not even one layer


@pytest.mark.parametrize(
    ("capacities", "layers", "expected"),
    [
        ([10, 10], 20, ([10, 10], False)),
        ([10, 10, 10], 10, ([4, 3, 3], False)),
        ([3, 10], 12, ([3, 9], True)),
        ([1, 100], 50, ([1, 49], True)),  # a stage never gets zero layers
        ([30, 5, 5], 30, ([22, 4, 4], True)),
        ([3, 3], 7, None),
        ([0, 10], 5, None),
        ([5, 5, 5], 2, None),  # more stages than layers
    ],
)
def test_layer_counts(capacities, layers, expected):
    assert layer_counts(capacities, layers) == expected


@given(st.lists(st.integers(0, 60), min_size=1, max_size=12), st.integers(1, 200))
def test_layer_counts_are_contiguous_positive_and_within_capacity(capacities, layers):
    result = layer_counts(capacities, layers)
    clipped = [min(c, layers) for c in capacities]
    if len(capacities) > layers or min(clipped) < 1 or sum(clipped) < layers:
        assert result is None
        return
    assert result is not None
    counts, uneven = result
    assert sum(counts) == layers
    assert all(1 <= n <= c for n, c in zip(counts, capacities, strict=True))
    assert uneven == (max(counts) - min(counts) > 1)
    base = layers // len(capacities)
    even_fits = min(clipped) >= base and sum(c > base for c in clipped) >= layers % len(clipped)
    assert uneven == (not even_fits)


def test_proportional_split_tracks_capacity():
    counts, uneven = layer_counts([10, 20, 30], 30)
    assert not uneven and counts == [10, 10, 10]
    counts, uneven = layer_counts([5, 20, 35], 48)
    assert uneven and counts == [4, 16, 28]


# ---- groups and nodes -------------------------------------------------------------------


def test_tensor_parallel_ranks_stay_on_one_node_and_stages_may_span_nodes():
    devices = [_dev(n, str(i), 20) for n in "ab" for i in range(3)]
    choice = _place(devices, tp=2, pp=2, layers=8)
    _assert_valid(choice, devices, tp=2, pp=2, layers=8)
    assert [{d.node_id for d in s.devices} for s in choice.stages] == [{"a"}, {"b"}]
    assert [[d.device_id for d in s.devices] for s in choice.stages] == [["0", "1"], ["0", "1"]]


def test_no_node_with_enough_devices_for_tensor_parallel():
    devices = [_dev(n, "0", 40) for n in "abcd"]
    assert _place(devices, tp=2, layers=8) is None
    assert "node-local group(s) of 2 devices" in explain_no_fit(
        devices, tp=2, pp=1, num_layers=8, fixed_bytes=FIXED, layer_bytes=LAYER
    )


def test_fragmented_node_groups_its_roomy_devices_together():
    # Least-loaded order alternates roomy (10 layers) and small (2 layers) devices: runs
    # in that order hold 2 + 2 layers; pairing the roomy ones holds 10 + 2.
    devices = [_dev("a", str(i), free, i / 10) for i, free in enumerate([11, 3, 11, 3])]
    choice = _place(devices, tp=2, pp=2, layers=12, policy="least-loaded")
    assert _ids(choice) == ["a/0", "a/2", "a/1", "a/3"]
    assert _counts(choice) == [10, 2] and choice.uneven


# ---- policies ---------------------------------------------------------------------------

LOADS = {"0": 0.0, "1": 0.3, "2": 0.5, "3": 0.8}


def _loaded(free_gib=20):
    return [_dev("a", dev, free_gib, load) for dev, load in LOADS.items()]


def test_hybrid_packs_onto_the_busiest_devices_below_theta():
    assert _ids(_place(_loaded())) == ["a/2"]
    assert _ids(_place(_loaded(), pp=2)) == ["a/1", "a/2"]


def test_hybrid_spreads_when_every_device_is_above_theta():
    devices = [_dev("a", "0", 20, 0.9), _dev("a", "1", 20, 0.75), _dev("b", "0", 20, 0.8)]
    assert _ids(_place(devices)) == ["a/1"]
    assert _ids(_place(devices, pp=2)) == ["a/1", "b/0"]


def test_hybrid_falls_back_to_lowest_load_when_the_packable_devices_are_too_small():
    devices = [_dev("a", "0", 3, 0.2), _dev("a", "1", 20, 0.95), _dev("a", "2", 20, 0.8)]
    assert _ids(_place(devices, layers=8)) == ["a/2"]


def test_hybrid_uses_packable_fragments_before_busy_devices():
    # Below θ only an uneven split fits; above θ an even one would: fragments win.
    devices = [_dev("a", "0", 4, 0.1), _dev("a", "1", 11, 0.2)]
    devices += [_dev("b", "0", 40, 0.9), _dev("b", "1", 40, 0.9)]
    choice = _place(devices, pp=2, layers=12)
    assert _ids(choice) == ["a/0", "a/1"] and choice.uneven


def test_hybrid_theta_is_a_knob():
    assert _ids(_place(_loaded(), theta=0.9)) == ["a/3"]
    assert _ids(_place(_loaded(), theta=0.0)) == ["a/0"]  # nothing packable: least-loaded


def test_hybrid_prefers_an_even_fit_among_packable_devices():
    # The busiest packable device only fits unevenly; an idler one fits evenly.
    devices = [_dev("a", "0", 4, 0.6), _dev("a", "1", 20, 0.5), _dev("a", "2", 20, 0.0)]
    choice = _place(devices, pp=2, layers=12)
    assert _ids(choice) == ["a/1", "a/2"] and not choice.uneven


def test_packing_takes_the_busiest_devices_that_fit_whatever_their_load():
    assert _ids(_place(_loaded(), policy="packing")) == ["a/3"]
    assert _ids(_place(_loaded(), pp=2, policy="packing")) == ["a/2", "a/3"]


def test_packing_best_fit_keeps_roomy_devices_free():
    devices = [_dev("a", "0", 40), _dev("a", "1", 10), _dev("b", "0", 12), _dev("b", "1", 8)]
    # 8 layers need 9 GiB: the smallest device that holds them.
    assert _ids(_place(devices, layers=8, policy="packing")) == ["a/1"]


def test_least_loaded_takes_the_idlest_devices_then_the_roomiest():
    assert _ids(_place(_loaded(), pp=2, policy="least-loaded")) == ["a/0", "a/1"]
    devices = [_dev("a", "0", 12), _dev("a", "1", 40), _dev("b", "0", 30)]
    assert _ids(_place(devices, policy="least-loaded")) == ["a/1"]


def test_least_loaded_groups_by_mean_load():
    devices = [_dev("a", str(i), 20, load) for i, load in enumerate([0.0, 0.6, 0.6, 0.6])]
    devices += [_dev("b", str(i), 20, 0.2) for i in range(2)]
    choice = _place(devices, tp=2, policy="least-loaded")
    assert _ids(choice) == ["b/0", "b/1"]  # mean 0.2 beats a's best pair at 0.3


def test_policy_is_recorded_and_unknown_policies_are_refused():
    assert _place(_loaded(), policy="least-loaded").policy == "least-loaded"
    with pytest.raises(ValueError, match="unknown placement policy 'spread'"):
        _place(_loaded(), policy="spread")


def test_ties_fall_to_node_then_device_id_whatever_the_input_order():
    devices = [_dev(n, str(i), 20) for n in "cab" for i in (1, 0)]
    for policy in POLICIES:
        expected = _place(devices, pp=2, policy=policy)
        assert _ids(expected) == ["a/0", "a/1"]
        for seed in range(5):
            shuffled = random.Random(seed).sample(devices, len(devices))
            assert _place(shuffled, pp=2, policy=policy) == expected


# ---- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "phrase"),
    [
        ({"tp": 0}, "at least 1"),
        ({"pp": 0}, "at least 1"),
        ({"pp": 9, "layers": 8}, "cannot split 8 layers into 9"),
        ({"fixed": -1}, "negative"),
        ({"layer": -1}, "negative"),
        ({"theta": 1.5}, "theta"),
    ],
)
def test_bad_arguments(kw, phrase):
    with pytest.raises(ValueError, match=phrase):
        _place(_loaded(), **kw)


def test_a_device_listed_twice_is_refused():
    with pytest.raises(ValueError, match="listed twice"):
        _place([_dev("a", "0", 20), _dev("a", "0", 10)])


@pytest.mark.parametrize(
    ("devices", "kw", "phrase"),
    [
        ([], {}, "no live devices"),
        ([_dev("a", "0", 40)], {"tp": 2}, "needs 2 devices, the cluster has 1"),
        ([_dev("a", "0", 1.5), _dev("a", "1", 40)], {"pp": 2}, "only 1 device(s) have 2048 MiB"),
        ([_dev("a", "0", 4), _dev("a", "1", 11)], {"pp": 2, "num_layers": 14}, "hold 13 of 14"),
        ([_dev("a", "0", 40)], {}, "fits"),
    ],
)
def test_explain_no_fit(devices, kw, phrase):
    args = {"tp": 1, "pp": 1, "num_layers": 8, "fixed_bytes": FIXED, "layer_bytes": LAYER, **kw}
    reason = explain_no_fit(devices, **args)
    assert phrase in reason and "\n" not in reason
    assert (place(devices, **args) is None) == (phrase != "fits")


# ---- properties against brute force -----------------------------------------------------


def _stage_capacities(devices, tp, pp, layers):
    """Capacities of the stages of every choice of pp disjoint node-local groups."""
    caps = [min(layers, max(0, (d.free_bytes - FIXED) // LAYER)) for d in devices]
    found = []

    def walk(left: list[int], held: list[int]) -> None:
        if len(held) == pp:
            found.append(held)
            return
        for group in itertools.combinations(left, tp):
            least = min(caps[i] for i in group)
            if len({devices[i].node_id for i in group}) == 1 and least >= 1:
                rest = [i for i in left if i > group[0] and i not in group]
                walk(rest, [*held, least])

    walk(list(range(len(devices))), [])
    return found


def _fits(devices, tp, pp, layers) -> tuple[bool, bool]:
    """(some placement fits, some placement fits evenly), by trying every choice."""
    maps = [layer_counts(held, layers) for held in _stage_capacities(devices, tp, pp, layers)]
    return any(maps), any(m is not None and not m[1] for m in maps)


_cluster = st.lists(
    st.tuples(st.sampled_from("ab"), st.floats(0, 12), st.floats(0, 1)), min_size=1, max_size=6
).map(
    lambda specs: [
        _dev(node, str(i), free, round(load, 2)) for i, (node, free, load) in enumerate(specs)
    ]
)


@settings(max_examples=200, deadline=None)
@given(
    _cluster,
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(1, 24),
    st.sampled_from(POLICIES),
)
def test_place_matches_brute_force(devices, tp, pp, layers, policy):
    """Valid whenever it answers, None only when nothing fits, and even whenever the
    devices the policy settles on allow an even split."""
    if pp > layers:
        return
    choice = _place(devices, tp=tp, pp=pp, layers=layers, policy=policy)
    fits, fits_evenly = _fits(devices, tp, pp, layers)
    assert (choice is not None) == fits
    if choice is None:
        return
    _assert_valid(choice, devices, tp=tp, pp=pp, layers=layers)
    assert choice.policy == policy
    if policy == "hybrid":
        packable = [d for d in devices if d.load < 0.7]
        packable_fits, packable_evenly = _fits(packable, tp, pp, layers)
        if packable_fits:
            assert all(d.load < 0.7 for d in choice.devices)
            fits_evenly = packable_evenly
    assert choice.uneven == (not fits_evenly)


# ---- scale ------------------------------------------------------------------------------


def _cluster_of(nodes: int, per_node: int, seed: int) -> list[Candidate]:
    rng = random.Random(seed)
    return [
        _dev(f"n{n:03d}", str(i), rng.uniform(0, 48), rng.random())
        for n in range(nodes)
        for i in range(per_node)
    ]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("tp", "pp", "layers"), [(1, 1, 32), (2, 4, 80), (8, 1, 16), (4, 8, 96)])
def test_a_thousand_devices_place_quickly(policy, tp, pp, layers):
    devices = _cluster_of(128, 8, seed=tp * 10 + pp)
    start = time.perf_counter()
    choice = _place(devices, tp=tp, pp=pp, layers=layers, policy=policy, layer=GIB // 2)
    elapsed = time.perf_counter() - start
    assert choice is not None
    _assert_valid(choice, devices, tp=tp, pp=pp, layers=layers, layer=GIB // 2)
    assert elapsed < 1.0  # generous: bench/placement_scale.py measures the real figure


def test_a_thousand_fragmented_devices_take_an_uneven_map():
    # Every device has 2–9 GiB free; 64 layers of 1 GiB on 4 stages need 17 GiB each evenly.
    rng = random.Random(7)
    devices = [_dev(f"n{n:03d}", str(i), rng.uniform(2, 9.5)) for n in range(128) for i in range(8)]
    devices[100] = _dev(devices[100].node_id, devices[100].device_id, 40)
    devices[500] = _dev(devices[500].node_id, devices[500].device_id, 30)
    choice = _place(devices, pp=4, layers=64, policy="packing")
    assert choice is not None and choice.uneven
    _assert_valid(choice, devices, tp=1, pp=4, layers=64)
