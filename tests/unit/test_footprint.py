"""Fingerprint layers timed with the full model's weight footprint
(monitor_agent.engine.footprint): how many copies of a stage's layers a forward cycles
through, and copies that compute what the layers do."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from monitor_agent.engine.engine import Engine
from monitor_agent.engine.footprint import (
    MAX_COPY_BYTES,
    MAX_LAYER_SETS,
    copy_weights,
    layer_bytes,
    layer_sets_for,
)
from monitor_agent.engine.sampling import SamplingConfig
from services.models.checkpoint import create_checkpoint

MIB = 1 << 20


def test_layer_sets_cover_the_full_stage_within_the_reserved_bytes():
    # Hidden 512 in float32: 2 layers of 11 MB, a 24-layer stage (264 MB). Twice a 32 MB
    # L3 (3 sets) left the fingerprints' decode layer 4-22 % faster than the full
    # model's; the copies now reach the stage's bytes, here as far as the job's 182 MiB
    # for copies goes: 9 sets, 198 MB.
    assert layer_sets_for(2, 24, 11 * MIB) == 1 + MAX_COPY_BYTES // (22 * MIB) == 9
    # A full model within the copies' bytes is copied to its own size.
    assert layer_sets_for(2, 6, 2.8 * MIB) == 3
    assert layer_sets_for(1, 60, 1024) == 60
    # The checkpoint itself: the layers alone; so are layers larger than the copies' bytes.
    assert layer_sets_for(24, 24, 11 * MIB) == 1
    assert layer_sets_for(1, 60, 400 * MIB) == 1
    assert layer_sets_for(1, 200, 1024) == MAX_LAYER_SETS


@given(own=st.integers(1, 4), extra=st.integers(0, 100), each=st.integers(1, 1 << 30))
def test_layer_sets_reach_the_stage_with_the_fewest_copies(own, extra, each):
    full = own + extra
    sets = layer_sets_for(own, full, each)
    if extra == 0:
        assert sets == 1
        return
    assert 1 <= sets <= MAX_LAYER_SETS
    assert (sets - 1) * own * each <= MAX_COPY_BYTES
    if sets < MAX_LAYER_SETS and sets * own * each <= MAX_COPY_BYTES:
        assert sets * own >= full  # the whole stage, when the bytes allow
    assert (sets - 1) * own < full or sets == 1


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
    checkpoint, weight_quant, pruning, kv_cache_dtype
):
    variant = dict(weight_quant=weight_quant, pruning=pruning, kv_cache_dtype=kv_cache_dtype)
    plain = Engine(checkpoint, max_seq_len=64, time_layers=True, **variant)
    expected = _tokens(plain)
    engine = Engine(checkpoint, max_seq_len=64, time_layers=True, footprint_layers=32, **variant)
    model = engine.model
    each = layer_bytes(model.layers)
    count = len(model.layer_sets)
    assert count == min(32 // 2, 1 + int(MAX_COPY_BYTES // (2 * each))) == 16
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
