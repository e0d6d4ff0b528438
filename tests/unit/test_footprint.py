"""Fingerprint layers timed with the full model's cache footprint
(monitor_agent.engine.footprint): the cache size the kernel reports, how many copies of a
stage's layers a forward cycles through, and copies that compute what the layers do."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from monitor_agent.engine import footprint
from monitor_agent.engine.engine import Engine
from monitor_agent.engine.footprint import (
    CACHE_MULTIPLE,
    MAX_COPY_BYTES,
    MAX_LAYER_SETS,
    copy_weights,
    last_level_cache_bytes,
    layer_bytes,
    layer_sets_for,
)
from monitor_agent.engine.sampling import SamplingConfig
from services.models.checkpoint import create_checkpoint

MIB = 1 << 20


def _cache_dir(root, core, index, level, kind, size):
    d = root / f"devices/system/cpu/cpu{core}/cache/index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "type").write_text(f"{kind}\n")
    (d / "size").write_text(f"{size}\n")


def test_the_last_level_cache_is_the_highest_data_or_unified_level_of_the_core(tmp_path):
    for core, l3 in ((0, "32768K"), (3, "16M")):
        _cache_dir(tmp_path, core, 0, 1, "Data", "48K")
        _cache_dir(tmp_path, core, 1, 1, "Instruction", "32K")
        _cache_dir(tmp_path, core, 2, 2, "Unified", "1024K")
        _cache_dir(tmp_path, core, 3, 3, "Unified", l3)
    assert last_level_cache_bytes(0, tmp_path) == 32 * MIB
    assert last_level_cache_bytes(3, tmp_path) == 16 * MIB


def test_without_sysfs_the_cache_is_glibc_s_figure_or_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sysconf", lambda name: 8 * MIB if "LEVEL3" in name else -1)
    monkeypatch.setattr(os, "sysconf_names", {"SC_LEVEL3_CACHE_SIZE": 1})
    assert last_level_cache_bytes(0, tmp_path) == 8 * MIB
    monkeypatch.setattr(os, "sysconf_names", {})
    assert last_level_cache_bytes(0, tmp_path) == 0


def test_layer_sets_cover_the_full_stage_up_to_twice_the_cache():
    # Hidden 512 in float32 on a 32 MB L3: 2 layers of 11 MB, a 24-layer stage: 64 MB
    # (twice the cache) is touched between two uses of a copy: 3 copies.
    assert layer_sets_for(2, 24, 11 * MIB, 32 * MIB) == 3
    # A full model that fits the cache (6 layers of 2.8 MB) is copied to its own size.
    assert layer_sets_for(2, 6, 2.8 * MIB, 32 * MIB) == 3
    # The checkpoint itself, or no cache figure: the layers alone.
    assert layer_sets_for(24, 24, 11 * MIB, 32 * MIB) == 1
    assert layer_sets_for(2, 24, 11 * MIB, 0) == 1
    # Layers larger than the cache: no copies needed beyond what the target asks.
    assert layer_sets_for(1, 60, 400 * MIB, 32 * MIB) == 1
    assert layer_sets_for(1, 60, 1024, 1 << 30) == 60  # the full stage itself
    assert layer_sets_for(1, 200, 1024, 1 << 30) == MAX_LAYER_SETS
    # A cache larger than the job reserved for copies: as many copies as it holds.
    assert layer_sets_for(1, 500, 100 * MIB, 1 << 30) == 1 + MAX_COPY_BYTES // (100 * MIB)


@given(
    own=st.integers(1, 4),
    extra=st.integers(0, 100),
    each=st.integers(1, 1 << 30),
    cache=st.integers(1, 1 << 31),
)
def test_layer_sets_reach_the_target_with_the_fewest_copies(own, extra, each, cache):
    full = own + extra
    sets = layer_sets_for(own, full, each, cache)
    target = min(full * each, CACHE_MULTIPLE * cache)
    if extra == 0:
        assert sets == 1
        return
    assert 1 <= sets <= MAX_LAYER_SETS
    assert (sets - 1) * own * each <= MAX_COPY_BYTES
    if sets < MAX_LAYER_SETS and sets * own * each <= MAX_COPY_BYTES:
        assert sets * own * each >= target
    assert (sets - 1) * own * each < target or sets == 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return create_checkpoint(
        tmp_path_factory.mktemp("fp") / "m", hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2,
    )  # fmt: skip


def _tokens(engine: Engine) -> list[int]:
    prompt = list(range(5, 21))
    greedy = SamplingConfig(ignore_eos=True)
    return [o.token_id for o in engine.generate(prompt, 12, greedy)]


@pytest.mark.parametrize(
    ("weight_quant", "pruning", "kv_cache_dtype"),
    [
        ("none", "none", None),
        ("int8", "none", None),
        ("int4", "none", "int8"),
        ("none", "2:4", None),
        ("none", "2:4-compact", None),
        ("none", "structured", None),
    ],
)
def test_copies_compute_what_the_layers_do_and_stay_outside_the_memory_account(
    checkpoint, weight_quant, pruning, kv_cache_dtype, monkeypatch
):
    variant = dict(weight_quant=weight_quant, pruning=pruning, kv_cache_dtype=kv_cache_dtype)
    plain = Engine(checkpoint, max_seq_len=64, time_layers=True, **variant)
    expected = _tokens(plain)
    monkeypatch.setattr(footprint, "last_level_cache_bytes", lambda: 1 * MIB)
    engine = Engine(checkpoint, max_seq_len=64, time_layers=True, footprint_layers=32, **variant)
    model = engine.model
    each = layer_bytes(model.layers)
    count = len(model.layer_sets)
    assert count == math.ceil(min(32 * each, 2 * MIB) / (2 * each)) > 1
    assert model.layer_sets[0] is model.layers
    # Every forward runs on the next copy, and the tokens are the layers' own.
    assert _tokens(engine) == expected
    assert model._forwards == 12  # one prefill and 11 decode steps
    copy = model.layer_sets[1][0]
    original = model.layers[0]
    assert copy.self_attn.kv_cache is original.self_attn.kv_cache
    for (name, a), (_, b) in zip(original.named_parameters(), copy.named_parameters(), strict=True):
        assert torch.equal(a, b), name
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), name
    assert engine.memory.weight_bytes == plain.memory.weight_bytes
    assert engine.layer_clock.decode_layer_passes == 11 * 1  # of 2 layers, the second


def test_a_copy_shares_a_tensor_parallel_hook_and_owns_its_tensor_attributes(checkpoint):
    engine = Engine(checkpoint, max_seq_len=32)
    layer = engine.model.layers[0]
    layer.mlp.reduce = hook = lambda x: x  # as tensor parallelism sets it
    twin = copy_weights(layer)
    assert twin.mlp.reduce is hook
    fused = layer.self_attn.qkv_weight
    assert fused is not None and torch.equal(twin.self_attn.qkv_weight, fused)
    assert twin.self_attn.qkv_weight.data_ptr() != fused.data_ptr()


def test_without_footprint_layers_or_on_the_checkpoint_itself_nothing_is_copied(checkpoint):
    assert Engine(checkpoint, max_seq_len=32, time_layers=True).model.layer_sets == ()
    same = Engine(checkpoint, max_seq_len=32, time_layers=True, footprint_layers=2)
    assert same.model.layer_sets == ()
    # Serving engines keep no clock and never copy.
    serving = Engine(checkpoint, max_seq_len=32, footprint_layers=32)
    assert serving.model.layer_sets == ()
