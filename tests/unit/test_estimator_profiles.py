"""Stored profile measurements to estimation inputs (services/estimation/profiles.py)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from estimator_svc.calibration_message import from_proto, load_shipped
from fingerprint_svc.importing import plan_maveriq_import
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.estimation import model_references, profiles
from services.estimation.extrapolate import LatencySample
from services.estimation.latency import REFERENCE_LAYOUTS
from services.estimation.references import extrapolate_references
from services.estimation.space import ModelShape, enumerate_space
from services.importers.maveriq import load_directory
from tests.unit.estimator_data import TRUTH, profiler_rows, shared_data

GIB = 1 << 30


@pytest.fixture(scope="module")
def a6000():
    """Every model of the A6000 data as the import stores it: {id: (model, measurements)}."""
    directory = shared_data()
    if not (directory / "fingerprint_data_collection.csv").is_file():
        pytest.skip(f"MaverIQ A6000 data not found under {directory}")
    files = [(p.name, p.read_bytes()) for p in sorted(directory.iterdir()) if p.is_file()]
    plan = plan_maveriq_import(files, "rtx-a6000")
    return {
        m.model_id: (
            model_pb.Model(model_id=m.model_id, shape=m.shape, variants=m.variants),
            m.measurements,
        )
        for m in plan.models
    }


def references(a6000, model_id: str) -> model_references.ModelReferences:
    model, rows = a6000[model_id]
    return model_references.model_references(
        profiles.estimation_shape(model),
        profiles.estimation_variants(model, rows),
        [profiles.sample_from_measurement(m) for m in rows],
    )


def test_a6000_references_match_the_direct_extrapolation_of_the_csv_rows(a6000):
    """The adapter reproduces docs/estimation.md's method on the raw MaverIQ records:
    923-token rows plus the short-prompt rows at batch 1 and 2, memory from 923-token rows
    with each layer's weights and KV cache known from the architecture, TP ladder with
    TTFT only."""
    data = load_directory(shared_data())
    layouts = REFERENCE_LAYOUTS + ((4, 1), (8, 1))
    long_rows, short_rows = collections.defaultdict(list), collections.defaultdict(list)
    for r in data.fingerprints:
        if r.model == "llama-2-13b" and (r.tp, r.pp) in layouts:
            long_rows[(r.variant, (r.tp, r.pp))].append(r)
    for r in data.fingerprints_batch:
        if r.model == "llama-2-13b":
            short_rows[(r.variant, (r.tp, r.pp))].append(r)
    latency = {
        key: [LatencySample(r.layers, r.latency_s, r.output_tokens, prompt="long") for r in rows]
        + [
            LatencySample(r.layers, r.latency_s, r.output_tokens, prompt=("short", r.batch_size))
            for r in short_rows.get(key, [])
        ]
        for key, rows in long_rows.items()
    }
    memory = {
        key: ([r.layers for r in rows], [r.memory_gib for r in rows])
        for key, rows in long_rows.items()
    }
    # Known per-layer memory: Llama-2-13B's layer (q, k, v, o of 5120 x 5120, gate, up,
    # down of 5120 x 13824, two norms), in TensorRT-LLM's formats, plus the K and V of
    # 923 + 20 tokens (5120 wide; float16, or int8 with int8_kv_cache).
    params = 4 * 5120 * 5120 + 3 * 5120 * 13824 + 2 * 5120
    per_weight = {
        "fp16": 2.0,
        "int8": 1 + 2 / 5120,
        "int4": 0.5 + 2 / 5120,
        "int4_gptq": 0.5 + 4 / 128,
    }
    slopes = {
        key: (params * per_weight[key[1]] + 2 * 5120 * (1 if key[2] else 2) * 943) / GIB
        for key, _ in long_rows
    }
    direct = extrapolate_references(
        40, latency, memory, "long", layouts, ("ttft",), memory_slopes=slopes
    )

    refs = references(a6000, "llama-2-13b")
    assert refs.layouts == layouts
    assert [p.input_tokens for p in refs.prompts] == [923]
    assert refs.prompts[0].kv_tokens_profiled == 923 + 20  # prompt + the longest output
    for variant, profile in zip(refs.variants, refs.prompts[0].profiles, strict=True):
        weight = variant.weight_quant
        expected = direct[("llama-2-13b", weight, variant.kv_quant == "int8")]
        for field in ("ttft_s", "tpot_s", "memory_gib"):
            # The service spreads the final norm (5120 weights) over the layers: 1e-6.
            np.testing.assert_allclose(
                getattr(profile.batch1, field), getattr(expected, field), rtol=1e-6
            )


def test_a6000_variants_accuracy_and_batch_model(a6000):
    refs = references(a6000, "llama-2-70b")
    names = [v.name for v in refs.variants]
    assert names == ["fp16", "fp16-kv8", "int8", "int8-kv8", "int4", "int4-kv8", "int4_gptq"]
    accuracy = {v.name: v.accuracy_pct for v in refs.variants}
    assert accuracy["int4"] == 95.4 and accuracy["int4_gptq"] == 55.7 and accuracy["fp16"] == 100
    assert {v.kv_quant for v in refs.variants} == {"fp16", "int8"}
    # Batch 2 was profiled with short prompts: every variant gets batch-2 references.
    profile = refs.prompts[0].profiles[0]
    assert profile.batch2 is not None and profile.batch2.layouts == refs.layouts
    assert np.all(np.isfinite(profile.batch1.ttft_s))
    # TPOT along the TP ladder is left to Eq. 2 (end-to-end rows are too noisy for it).
    assert np.isnan(profile.batch1.tpot_s[3:]).all()


def test_falcon_7b_has_no_tensor_parallel_references(a6000):
    refs = references(a6000, "falcon-7b")
    assert refs.layouts == REFERENCE_LAYOUTS and not refs.has_tp_ladder
    assert refs.shape.num_heads == 71
    # Its 71 heads allow no tp = 2: no configuration is estimated without the reference.
    assert not any(note.startswith("no fingerprint runs") for note in refs.notes)


def test_a_reference_layout_never_profiled_is_said():
    shape = ModelShape("tiny", 8, 8, 4, 16)
    model = model_pb.Model(model_id="tiny")
    rows = profiler_rows("", common.WEIGHT_QUANT_NONE)
    base_only = [m for m in rows if m.config.tensor_parallel * m.config.pipeline_parallel == 1]

    def notes(measurements):
        variants = profiles.estimation_variants(model, measurements)
        samples = [profiles.sample_from_measurement(m) for m in measurements]
        return model_references.model_references(shape, variants, samples).notes

    assert not any(n.startswith("no fingerprint runs") for n in notes(rows))
    said = notes(base_only)
    assert (
        "no fingerprint runs at tp=2 pp=1: tensor-parallel configurations are estimated "
        "without its communication cost"
    ) in said
    assert any(n.startswith("no fingerprint runs at tp=1 pp=2: pipeline-parallel") for n in said)

    # Which configurations lack their communication: tp > 1 or pp > 1, not (1, 1).
    def unprofiled(measurements):
        variants = profiles.estimation_variants(model, measurements)
        samples = [profiles.sample_from_measurement(m) for m in measurements]
        refs = model_references.model_references(shape, variants, samples)
        return refs.communication_unprofiled(np.array([1, 2, 1, 2]), np.array([1, 1, 2, 2]))

    assert unprofiled(base_only).tolist() == [False, True, True, True]
    assert unprofiled(rows).tolist() == [False, False, False, False]
    no_pipeline = [m for m in rows if m.config.pipeline_parallel == 1]
    assert unprofiled(no_pipeline).tolist() == [False, False, True, True]


def test_a6000_llama_70b_estimates_every_configuration_in_the_papers_range(a6000):
    refs = references(a6000, "llama-2-70b")
    calibration, refs = from_proto(load_shipped("rtx-a6000")).for_references(refs)
    estimates = model_references.estimate(
        refs, calibration, model_references.Workload(100), 8, 48e9 / GIB
    )
    space = enumerate_space(refs.shape, 8, refs.variants)
    assert estimates.space.size == space.size == 15 * 7
    fits = estimates.fits
    latency = estimates.latency_s[fits]
    # Papers: 2.7-21.5 s over 180 configurations (pruned ones included).
    assert 2.0 < latency.min() < 4.0 and 15.0 < latency.max() < 30.0
    memory_gb = estimates.memory_total_gib[fits] * GIB / 1e9
    assert 30 < memory_gb.min() < 50 and 130 < memory_gb.max() < 180


def test_a6000_llama_70b_ttft_grows_beyond_its_923_token_prompt(a6000):
    """MaverIQ's rows record one prompt length (923) beside the short-prompt batch rows'
    unrecorded one: a 3,900-token prompt's TTFT is 3 to 4.6 times the 923-token one's
    (prefill's work grows 4.3 times; a decode step's worth of it does not grow)."""
    refs = references(a6000, "llama-2-70b")
    assert [p.input_tokens for p in refs.prompts] == [923]
    at, longer = refs.at_input(923)[0].batch1, refs.at_input(3900)[0].batch1
    ratios = np.asarray(longer.ttft_s) / np.asarray(at.ttft_s)
    # The TP ladder's (4,1) and (8,1) too, whose TPOT is left to Eq. 2 (NaN) and which
    # went NaN, back to Eq. 2's (tp-1)^beta, at first.
    assert len(ratios) == 5 and np.all((ratios > 3.0) & (ratios < 1.1 * 3900 / 923)), ratios
    assert longer.tpot_s == at.tpot_s


# ---- the profiler's rows: TTFT and TPOT from token timestamps ----------------------------
def test_direct_ttft_tpot_rows_extrapolate_to_the_full_model():
    shape = ModelShape("tiny", 8, 8, 4, 16)
    model = model_pb.Model(model_id="tiny")
    model.variants.add(name="int8", weight_quant=common.WEIGHT_QUANT_INT8, accuracy_score=99.0)
    rows = profiler_rows("", common.WEIGHT_QUANT_NONE) + profiler_rows(
        "int8", common.WEIGHT_QUANT_INT8
    )
    variants = profiles.estimation_variants(model, rows)
    assert [v.weight_quant for v in variants.values()] == ["int8", "fp16"]
    assert variants["int8"].accuracy_pct == 99.0 and variants[""].accuracy_pct is None
    refs = model_references.model_references(
        shape, variants, [profiles.sample_from_measurement(m) for m in rows]
    )
    assert refs.layouts == REFERENCE_LAYOUTS
    assert "batch 2 was not profiled" in refs.notes[0]
    base = refs.prompts[0].profiles[0].batch1
    f_layer, f_other, p_layer, p_other = TRUTH[(1, 1)]
    assert base.ttft_s[0] == pytest.approx(8 * f_layer + f_other)
    assert base.tpot_s[0] == pytest.approx(8 * p_layer + p_other)
    assert base.memory_gib[0] == pytest.approx((8 * 100 + 500) / 1024)
    assert base.memory_gib[1] == pytest.approx((8 * 100 + 2 * 500) / 1024)
    assert refs.prompts[0].kv_tokens_profiled == 32 + 16


def test_prompt_lengths_are_interpolated_between_profiled_ones():
    shape = ModelShape("tiny", 8, 8, 4, 16)
    model = model_pb.Model(model_id="tiny")
    short = profiler_rows("", common.WEIGHT_QUANT_NONE, input_tokens=32)
    long = profiler_rows("", common.WEIGHT_QUANT_NONE, input_tokens=288)
    for m in long:  # prefill of the long prompt costs twice as much
        m.ttft_ms *= 2
    refs = model_references.model_references(
        shape,
        profiles.estimation_variants(model, short),
        [profiles.sample_from_measurement(m) for m in short + long],
    )
    assert [p.input_tokens for p in refs.prompts] == [32, 288]
    assert refs.default_input_tokens() == 288
    low = refs.at_input(32)[0].batch1.ttft_s[0]
    assert refs.at_input(160)[0].batch1.ttft_s[0] == pytest.approx(1.5 * low)
    assert refs.at_input(10)[0].batch1.ttft_s[0] == pytest.approx(low)
    # Beyond the longest: along the line through the two (+low per 256 tokens).
    assert refs.at_input(4000)[0].batch1.ttft_s[0] == pytest.approx(low * (1 + 3968 / 256))
    assert "extrapolated along the line" in refs.prompt_note(4000)
    assert "not extrapolated" in refs.prompt_note(10)


def test_a_layout_profiled_with_another_prompt_only_is_estimated_and_said():
    """Long-prompt rows at (1,1) alone beside short-prompt rows at every layout (a
    partial import next to MaverIQ's _BS file): every estimate failed with an INTERNAL
    KeyError for the (2,1) TTFT terms of the long prompt."""
    shape = ModelShape("tiny", 8, 8, 4, 16)
    model = model_pb.Model(model_id="tiny")
    short = profiler_rows("", common.WEIGHT_QUANT_NONE, input_tokens=32)
    long = [
        m
        for m in profiler_rows("", common.WEIGHT_QUANT_NONE, input_tokens=288)
        if m.config.tensor_parallel * m.config.pipeline_parallel == 1
    ]
    refs = model_references.model_references(
        shape,
        profiles.estimation_variants(model, short),
        [profiles.sample_from_measurement(m) for m in short + long],
    )
    assert [p.input_tokens for p in refs.prompts] == [32, 288]
    for layout in ("tp=2 pp=1: tensor", "tp=1 pp=2: pipeline"):
        assert (
            f"no fingerprint runs at {layout}-parallel configurations are estimated without "
            "its communication cost" not in refs.notes
        )
    assert (
        "no fingerprint runs at tp=2 pp=1 with the 288-token prompt: tensor-parallel "
        "configurations are estimated without its communication cost there"
    ) in refs.notes
    assert not any("32-token" in n for n in refs.notes)
    long_refs, short_refs = refs.at_input(288)[0].batch1, refs.at_input(32)[0].batch1
    # The long prompt's (2,1) and (1,2) carry no overhead of their own: Eq. 2 then charges
    # none; the short prompt's keep what they measured.
    assert long_refs.ttft_s[1] == pytest.approx(long_refs.ttft_s[0] / 2)
    assert long_refs.ttft_s[2] == pytest.approx(long_refs.ttft_s[0])
    assert short_refs.ttft_s[1] != pytest.approx(short_refs.ttft_s[0] / 2)
    assert np.all(np.isfinite(long_refs.ttft_s)) and np.all(np.isfinite(long_refs.tpot_s))
    assert refs.communication_unprofiled(np.array([1, 2, 1]), np.array([1, 1, 2])).tolist() == [
        False,
        True,
        True,
    ]


def _linear_in_prompt(lengths, ttft_per_token, tpot_per_token, layer_mib=100, ttft_per_pair=0.0):
    """Profiler rows at each prompt length whose TTFT and TPOT grow by the given
    seconds per prompt token (per layer and in the 'other' term alike), TTFT also by
    ``ttft_per_pair`` per pair of prompt tokens (attention's quadratic share), memory
    by ``layer_mib`` per layer at every length."""
    rows = []
    for n in lengths:
        for m in profiler_rows("", common.WEIGHT_QUANT_NONE, input_tokens=n, layer_mib=layer_mib):
            m.ttft_ms += 1e3 * (ttft_per_token * n + ttft_per_pair * n * n) * (m.num_layers + 1)
            m.tpot_ms += 1e3 * tpot_per_token * n * (m.num_layers + 1)
            rows.append(m)
    return rows


def _references(rows):
    return model_references.model_references(
        ModelShape("tiny", 8, 8, 4, 16),
        profiles.estimation_variants(model_pb.Model(model_id="tiny"), rows),
        [profiles.sample_from_measurement(m) for m in rows],
    )


def test_one_profiled_prompt_length_moves_ttft_with_prefill_s_work_either_way():
    """One prompt length (an import of 923-token measurements) read a 3,900-token
    prompt's TTFT as the 923-token one's (a tester), and a 100-token one's too. TTFT now
    follows prefill's work, n + k n^2 (k from the architecture), along the line through
    it and a one-token prompt's prefill, a decode step (TPOT), beyond it and below it;
    TPOT and memory stay. Without the MLP width (k unknown) nothing is extrapolated,
    and it is said."""
    from services.estimation.prompt_curve import attention_share, gated_layer_weights

    shape = ModelShape("tiny", 8, 8, 4, 16, mlp_width=64)
    k = attention_share(8 * 16, gated_layer_weights(8 * 16, 4 * 16, 64))
    rows = _linear_in_prompt((512,), 0.0, 0.0)
    variants = profiles.estimation_variants(model_pb.Model(model_id="tiny"), rows)
    samples = [profiles.sample_from_measurement(m) for m in rows]
    refs = model_references.model_references(shape, variants, samples)
    at = refs.at_input(512)[0]

    def work(n: int) -> float:
        return n + k * n * n

    for n in (100, 256, 1024, 8192):
        grown = refs.at_input(n)[0]
        along = (work(n) - work(1)) / (work(512) - work(1))
        ttft, tpot = np.asarray(at.batch1.ttft_s), np.asarray(at.batch1.tpot_s)
        assert np.all(ttft > tpot)
        assert grown.batch1.ttft_s == pytest.approx(tpot + along * (ttft - tpot)), n
        assert grown.batch1.tpot_s == at.batch1.tpot_s
        assert grown.batch1.memory_gib == at.batch1.memory_gib
        assert "a one-token prompt, whose prefill is a decode step" in refs.prompt_note(n)
        # Below it the same line (a chord of prefill's time, above it): between the
        # TPOT and the profiled TTFT (a 100-token prompt was read as a 512-token one).
        if n < 512:
            assert np.all((tpot < grown.batch1.ttft_s) & (grown.batch1.ttft_s < ttft)), n
            assert "shorter than the one prompt length profiled" in refs.prompt_note(n)
    unknown = model_references.model_references(ModelShape("tiny", 8, 8, 4, 16), variants, samples)
    assert unknown.at_input(8192)[0].batch1.ttft_s == at.batch1.ttft_s
    assert "not extrapolated" in unknown.prompt_note(8192)


def test_three_prompt_lengths_recover_prefill_s_linear_and_quadratic_terms():
    """TTFT = fixed + a * prompt + b * prompt^2 (weights, then attention): the parabola
    through the three profiled lengths is the curve, between them and beyond."""
    a, b = 2e-5, 3e-8
    refs = _references(_linear_in_prompt((64, 256, 1024), a, 0.0, ttft_per_pair=b))
    f_layer, f_other, _, _ = TRUTH[(1, 1)]
    for n in (100, 512, 1024, 2048, 8192):
        ttft = refs.at_input(n)[0].batch1.ttft_s[0]
        assert ttft == pytest.approx(8 * f_layer + f_other + (a * n + b * n * n) * 9), n
    assert "parabola through the 64-, 256- and 1024-token" in refs.prompt_note(8192)
    assert refs.prompt_note(512) is None


def test_beyond_the_longest_prompt_ttft_follows_prefill_s_shape_through_the_two_longest():
    """With the MLP width known, TTFT beyond the longest prompt is a + b (n + k n^2), k
    from the architecture (attention_share), through the two longest prompts: exact
    when the profile follows prefill's work, and unmoved by noise at the shortest, which
    bent the parabola (+58 % at 16k tokens on a probe's hidden-256 model)."""
    from services.estimation.prompt_curve import attention_share, gated_layer_weights

    shape = ModelShape("tiny", 8, 8, 4, 16, mlp_width=64)
    share = attention_share(8 * 16, gated_layer_weights(8 * 16, 4 * 16, 64))
    assert share == pytest.approx(1 / 576)
    a = 2e-5
    rows = _linear_in_prompt((64, 256, 1024), a, 0.0, ttft_per_pair=a * share)
    refs = model_references.model_references(
        shape,
        profiles.estimation_variants(model_pb.Model(model_id="tiny"), rows),
        [profiles.sample_from_measurement(m) for m in rows],
    )
    f_layer, f_other, _, _ = TRUTH[(1, 1)]
    for n in (2048, 8192, 32768):
        ttft = refs.at_input(n)[0].batch1.ttft_s[0]
        assert ttft == pytest.approx(8 * f_layer + f_other + (a * n + a * share * n * n) * 9), n
    assert "along prefill's shape" in refs.prompt_note(8192)
    # The shortest prompt's TTFT 20 % high: nothing beyond the longest moves.
    for m in rows:
        if m.input_tokens == 64:
            m.ttft_ms *= 1.2
    noisy = model_references.model_references(
        shape,
        profiles.estimation_variants(model_pb.Model(model_id="tiny"), rows),
        [profiles.sample_from_measurement(m) for m in rows],
    )
    for n in (2048, 8192, 32768):
        assert noisy.at_input(n)[0].batch1.ttft_s[0] == pytest.approx(
            refs.at_input(n)[0].batch1.ttft_s[0]
        )


@pytest.mark.parametrize(
    ("config", "mlp_matrices"),
    [
        # GPT-J: a plain MLP (two matrices), untied LM head with a bias.
        (
            {
                "model_type": "gptj",
                "architectures": ["GPTJForCausalLM"],
                "n_embd": 256,
                "n_layer": 3,
                "n_head": 4,
                "n_inner": 1024,
                "n_positions": 2048,
                "rotary_dim": 16,
                "vocab_size": 1000,
                "tie_word_embeddings": False,
            },
            2,
        ),
        # Falcon: a plain MLP, one KV head, tied embeddings.
        (
            {
                "model_type": "falcon",
                "architectures": ["FalconForCausalLM"],
                "hidden_size": 256,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "multi_query": True,
                "parallel_attn": True,
                "bias": False,
                "new_decoder_architecture": False,
                "vocab_size": 1000,
            },
            2,
        ),
        # Llama: a gated MLP (three matrices), grouped KV heads.
        (
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 256,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 688,
                "vocab_size": 1000,
                "max_position_embeddings": 2048,
            },
            3,
        ),
    ],
)
def test_prefill_s_attention_share_counts_the_layer_s_own_weights(config, mlp_matrices):
    """k = H / P with P the decoder layer's weights as the registered record counts them
    (its parameters less embedding and LM head): a plain MLP's two matrices for GPT-J
    and Falcon, not a gated MLP's three (which made their k about 25 % low)."""
    from fingerprint_svc.registry import model_shape
    from services.models.families import parse_config

    spec = parse_config(config)
    record = model_pb.Model(model_id="m", shape=model_shape(spec, spec.weight_bytes()))
    shape = profiles.estimation_shape(record)
    h, kv, inner = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    weights = 2 * h * h + 2 * h * kv + mlp_matrices * h * inner
    # Norms and biases: a few H per layer beside the matrices' ~12 H^2.
    assert shape.layer_weights == pytest.approx(weights, rel=0.01)
    assert model_references._attention_share(shape) == pytest.approx(h / weights, rel=0.01)


def test_a_parabola_that_bends_down_is_held_to_the_line_and_between_its_neighbours():
    # Noise that curves the other way (b < 0): beyond the longest no lower than the line
    # through the two longest; between two lengths within their figures.
    refs = _references(_linear_in_prompt((64, 256, 1024), 2e-5, 0.0, ttft_per_pair=-1e-8))
    at = {n: refs.at_input(n)[0].batch1.ttft_s[0] for n in (256, 1024, 4096)}
    line = at[1024] + (at[1024] - at[256]) * (4096 - 1024) / (1024 - 256)
    assert at[4096] == pytest.approx(line)
    # A parabola whose lowest point (160 tokens) lies between two profiled lengths that
    # measured the same: held there, not dipped below them.
    dip = _references(_linear_in_prompt((64, 256, 1024), -3.2e-5, 0.0, ttft_per_pair=1e-7))
    ends = [dip.at_input(n)[0].batch1.ttft_s[0] for n in (64, 256)]
    assert ends[0] == pytest.approx(ends[1])
    assert dip.at_input(160)[0].batch1.ttft_s[0] == pytest.approx(ends[0])


def test_a_longer_prompt_recovers_the_line_the_profiled_prompts_lie_on():
    """TTFT linear in the prompt (prefill compute): two profiled lengths give the
    line, and a prompt 16 times the longer one is on it. TPOT terms are shared by the
    prompt labels (docs/estimation.md), so every length gets their fit: the mean
    prompt's."""
    shape = ModelShape("tiny", 8, 8, 4, 16)
    model = model_pb.Model(model_id="tiny")
    a_ttft, a_tpot = 2e-5, 1e-6
    rows = _linear_in_prompt((64, 256), a_ttft, a_tpot)
    refs = model_references.model_references(
        shape,
        profiles.estimation_variants(model, rows),
        [profiles.sample_from_measurement(m) for m in rows],
    )
    f_layer, f_other, p_layer, p_other = TRUTH[(1, 1)]
    for n in (64, 256, 1024, 4096):
        base = refs.at_input(n)[0].batch1
        assert base.ttft_s[0] == pytest.approx(8 * f_layer + f_other + a_ttft * n * 9)
        assert base.tpot_s[0] == pytest.approx(8 * p_layer + p_other + a_tpot * 160 * 9)


def test_a_longer_prompt_is_never_estimated_faster_than_the_longest_profiled():
    # Noise that timed the longer prompt faster must not extrapolate downwards.
    shape = ModelShape("tiny", 8, 8, 4, 16)
    model = model_pb.Model(model_id="tiny")
    rows = _linear_in_prompt((64, 256), -1e-6, -1e-7)
    refs = model_references.model_references(
        shape,
        profiles.estimation_variants(model, rows),
        [profiles.sample_from_measurement(m) for m in rows],
    )
    longest = refs.at_input(256)[0].batch1
    beyond = refs.at_input(2048)[0].batch1
    assert beyond.ttft_s == pytest.approx(longest.ttft_s)
    assert beyond.tpot_s == pytest.approx(longest.tpot_s)


def test_memory_follows_each_prompt_s_activations_over_the_worker_s_one_cache():
    """The profiler runs a job's prompts shortest first in one worker whose static cache
    holds the longest prompt: each prompt's rows hold that cache (the same per layer)
    and the activations of its prompt (per rank, linear in its tokens). Memory at a
    prompt is its rows', the cache's tokens the longest's; beyond, the line through the
    two longest, also where a pipeline rank's short prompt hid under its loading peak
    (a parabola through the three bends up without bound)."""
    mib_per_token = 0.01
    rows = []
    for n in (64, 256, 1024):
        for m in profiler_rows("", common.WEIGHT_QUANT_NONE, input_tokens=n):
            seen = 256 if m.config.pipeline_parallel == 2 and n == 64 else n
            extra = int(mib_per_token * seen * (1 << 20))
            m.peak_memory_bytes_per_rank[:] = [b + extra for b in m.peak_memory_bytes_per_rank]
            rows.append(m)
    refs = _references(rows)
    assert {p.kv_tokens_profiled for p in refs.prompts} == {1024 + 16}
    layouts = refs.prompts[0].profiles[0].batch1.layouts
    base, pipeline = layouts.index((1, 1)), layouts.index((1, 2))
    for n in (64, 256, 1024, 4096, 32768):
        memory_mib = np.asarray(refs.at_input(n)[0].batch1.memory_gib) * 1024
        assert memory_mib[base] == pytest.approx(8 * 100 + 500 + mib_per_token * n), n
        # Two ranks, each with its own pass's activations, over the same layers.
        expected = 8 * 100 + 2 * (500 + mib_per_token * max(n, 256))
        assert memory_mib[pipeline] == pytest.approx(expected, rel=1e-3), n


def test_references_need_fingerprints_at_the_base_layout():
    shape = ModelShape("tiny", 8, 8, 4, 16)
    model = model_pb.Model(model_id="tiny")
    rows = [m for m in profiler_rows("", common.WEIGHT_QUANT_NONE) if m.config.tensor_parallel == 2]
    with pytest.raises(ValueError, match=r"\(1,1\)"):
        model_references.model_references(
            shape,
            profiles.estimation_variants(model, rows),
            [profiles.sample_from_measurement(m) for m in rows],
        )


def test_workload_rejects_zero_output_tokens():
    with pytest.raises(ValueError, match="output_tokens"):
        model_references.Workload(output_tokens=0)


def test_the_profilers_base_variant_and_a_model_that_is_its_own_fingerprint():
    """The profiler names the base checkpoint ``base`` (config.variant_name ""), and for a
    2-layer model its pp + 1 fingerprint is the model itself (full_model = true)."""
    shape = ModelShape("two", 2, 8, 4, 16)
    model = model_pb.Model(model_id="two", accuracy_score=61.0)
    rows = profiler_rows("", common.WEIGHT_QUANT_NONE, model_layers=2)
    assert rows[0].variant_name == "base" and rows[0].config.variant_name == ""
    assert any(m.full_model for m in rows)
    variants = profiles.estimation_variants(model, rows)
    assert list(variants) == [""] and variants[""].accuracy_pct == 61.0
    refs = model_references.model_references(
        shape, variants, [profiles.sample_from_measurement(m) for m in rows]
    )
    f_layer, f_other, p_layer, p_other = TRUTH[(1, 1)]
    base = refs.prompts[0].profiles[0].batch1
    assert base.ttft_s[0] == pytest.approx(2 * f_layer + f_other)
    assert base.tpot_s[0] == pytest.approx(2 * p_layer + p_other)
    # At pp = 2 the only fingerprint is the whole model (pp + 1 = 3 layers, capped at 2):
    # its runs are the (1,2) reference, and no note says that layout was not profiled.
    f_layer, f_other, p_layer, p_other = TRUTH[(1, 2)]
    assert base.ttft_s[2] == pytest.approx(2 * f_layer + f_other)
    assert base.tpot_s[2] == pytest.approx(2 * p_layer + p_other)
    assert not any("no fingerprint runs" in note for note in refs.notes), refs.notes


def test_noise_never_makes_the_full_model_faster_than_its_fingerprints():
    shape = ModelShape("tiny", 8, 8, 4, 16)
    model = model_pb.Model(model_id="tiny")
    rows = profiler_rows("", common.WEIGHT_QUANT_NONE)
    for m in rows:  # the second layer timed faster: a negative per-layer TTFT
        if m.config.tensor_parallel == 1 and m.config.pipeline_parallel == 1 and m.num_layers == 2:
            m.ttft_ms = 5.0
        elif m.config.tensor_parallel == 1 and m.config.pipeline_parallel == 1:
            m.ttft_ms = 9.0
    refs = model_references.model_references(
        shape,
        profiles.estimation_variants(model, rows),
        [profiles.sample_from_measurement(m) for m in rows],
    )
    # Raised to what the largest fingerprint (2 layers) measured.
    assert refs.prompts[0].profiles[0].batch1.ttft_s[0] == pytest.approx(5e-3)


def test_a_further_sequence_of_a_longer_prompt_costs_at_least_its_prefill():
    """MaverIQ's batch-2 rows are short-prompt runs, whose TTFT overhead per sequence is
    about nothing: charged to a 923-token prompt it made TTFT flat in the batch (a 70B
    model prefilling 64 such prompts in 0.44 s on four A6000s)."""
    from services.estimation.latency import REFERENCE_LAYOUTS
    from services.estimation.references import ReferenceProfile

    layouts = (*REFERENCE_LAYOUTS, (4, 1))
    main = ReferenceProfile(layouts, (1.0, 0.6, 1.1, 0.4), (0.1, 0.06, 0.11, 0.04), (1, 1, 1, 1))
    one = ReferenceProfile(REFERENCE_LAYOUTS, (0.2, 0.12, 0.21), (0.1, 0.06, 0.11), (1, 1, 1))
    two = ReferenceProfile(REFERENCE_LAYOUTS, (0.19, 0.12, 0.2), (0.1, 0.06, 0.11), (1, 1, 1))
    same = model_references._batch2(main, one, two)  # the overhead as measured
    assert same.ttft_s == pytest.approx((0.99, 0.6, 1.09, 0.4))
    longer = model_references._batch2(main, one, two, longer_prompt=True)
    # At least main - one at each reference layout; a ladder layout (4,1) the (2,1)
    # one's share 2/4.
    assert longer.ttft_s == pytest.approx((1.8, 1.08, 1.99, 0.4 + 0.5 * 0.48))
    assert longer.tpot_s == main.tpot_s  # decode's overhead is the prompt's own business


def test_a_parallel_layout_s_further_sequence_costs_at_least_its_share_of_1_1_s():
    """A layout whose batch-2 difference timed within noise (about nothing) decoded batch
    64 as fast as batch 1 while (1,1)'s grew 19-fold (a probe): the extra sequence's work
    does not vanish in parallel. Each reference's overhead is at least (1,1)'s over its
    tensor degree; (1,1)'s own, and one above the floor, are as measured."""
    from services.estimation.latency import REFERENCE_LAYOUTS
    from services.estimation.references import ReferenceProfile

    layouts = (*REFERENCE_LAYOUTS, (4, 1))
    main = ReferenceProfile(layouts, (1.0, 0.6, 1.1, 0.4), (0.1, 0.06, 0.11, 0.04), (1, 1, 1, 1))
    one = ReferenceProfile(REFERENCE_LAYOUTS, (0.2, 0.12, 0.21), (0.1, 0.06, 0.11), (1, 1, 1))
    # (1,1): +0.04 s TTFT, +0.02 s TPOT per sequence; (2,1) and (1,2) flat (noise).
    two = ReferenceProfile(REFERENCE_LAYOUTS, (0.24, 0.12, 0.21), (0.12, 0.06, 0.11), (1, 1, 1))
    floored = model_references._batch2(main, one, two)
    assert floored.ttft_s == pytest.approx((1.04, 0.62, 1.14, 0.4 + 0.5 * 0.02))
    assert floored.tpot_s == pytest.approx((0.12, 0.07, 0.13, 0.04 + 0.5 * 0.01))
    # Above the floor: as measured.
    steep = ReferenceProfile(REFERENCE_LAYOUTS, (0.24, 0.2, 0.3), (0.12, 0.1, 0.2), (1, 1, 1))
    measured = model_references._batch2(main, one, steep)
    assert measured.tpot_s == pytest.approx((0.12, 0.1, 0.2, 0.04 + 0.5 * 0.04))


def test_a_profile_other_processes_slowed_is_said_with_its_estimates():
    """Estimates from runs other processes slowed run high: the references
    say so (the note the estimator's replies carry), and say nothing of quiet runs."""
    shape = ModelShape("tiny", 8, 8, 4, 16)
    model = model_pb.Model(model_id="tiny")
    rows = profiler_rows("", common.WEIGHT_QUANT_NONE)
    variants = profiles.estimation_variants(model, rows)

    def notes(ratio: float | None) -> tuple[str, ...]:
        for m in rows:
            if ratio is None:
                m.ClearField("other_cpu_share")
            else:
                m.other_cpu_share = ratio
        samples = [profiles.sample_from_measurement(m) for m in rows]
        return model_references.model_references(shape, variants, samples).notes

    said = "of the devices' CPU cores"
    assert not any(said in n for n in notes(0.08))
    assert not any(said in n for n in notes(None))
    [slowed] = [n for n in notes(0.8) if said in n]
    assert slowed.startswith(f"{len(rows)} of {len(rows)} profiled measurements")
    assert "other processes used up to 80% of the devices' CPU cores" in slowed
