"""The MaverIQ importer on the real A6000 files, and the reference extrapolation on them.

Skipped when the shared data is not beside the repository (``X/main`` and
``X/shared/data``) and ``ISERVE_SHARED_DATA`` does not point at it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from services.estimation.extrapolate import LatencySample
from services.estimation.references import extrapolate_references
from services.importers.maveriq import AccuracyKey, load_accuracy, load_directory, load_measurements


def _data_dir() -> Path:
    env = os.environ.get("ISERVE_SHARED_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"
    return base / "maveriq-a6000"


DATA = _data_dir()
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"MaverIQ data not found at {DATA}")


@pytest.fixture(scope="module")
def data():
    return load_directory(DATA)


def test_every_file_parses_into_records(data):
    assert len(data.fingerprints) == 1684
    assert len(data.full_models) == 1355
    assert len(data.full_models_batch) == 675
    assert {r.model for r in data.full_models} == {
        "falcon-7b",
        "gptj-6b",
        "llama-2-7b",
        "llama-2-13b",
    }
    assert {r.weight_quant for r in data.fingerprints} == {"fp16", "int8", "int4", "int4_gptq"}
    assert {r.output_tokens for r in data.full_models} == {10, 20, 50, 100, 200}
    assert {r.batch_size for r in data.fingerprints_batch} == {1, 2}
    assert {r.pruning for r in data.full_models_pruned} == {
        "sparseGPT",
        "wanda",
        "wanda24",
        "wanda48",
    }


def test_first_rows_read_as_published(data):
    row = data.full_models[0]
    assert (row.model, row.tp, row.pp, row.pp_map, row.weight_quant) == (
        "falcon-7b",
        1,
        1,
        (32,),
        "fp16",
    )
    assert (row.int8_kv_cache, row.output_tokens, row.batch_size) == (False, 10, 1)
    assert row.latency_s == pytest.approx(0.34945249557495117)
    # The footprint is Memory-After-Run (GiB, growth summed over the GPUs).
    assert row.memory_gib == pytest.approx(13.95623779296875)
    assert row.memory_pre_run_gib == pytest.approx(13.89569091796875)
    fingerprint = data.fingerprints[2]
    assert fingerprint.layers == 2 and fingerprint.pp_map == (2,)
    staged = next(r for r in data.fingerprints if r.pp == 2)
    assert staged.pp_map == (1, 1) and staged.layers == 2


def test_accuracy_fixes_the_misspelled_gptj_key(data):
    table = data.accuracy_pct
    assert table[AccuracyKey("gptj-6b", "int4", False)] == pytest.approx(96.4)
    assert table[AccuracyKey("llama-2-7b", "int4_gptq", False)] == pytest.approx(87.3)
    assert not any(key.model == "gtpj-6b" for key in table)
    assert table == load_accuracy(DATA / "MS_model_acc_MMLU.json")


def test_bad_rows_name_the_file_and_line(tmp_path):
    header = "Model,TP,PP,PP_Map,DTYPE,INT8_KV_Cache,Output_Lenght,Batch_Size,Latency,Memory-Pre-Run,Memory-After-Run\n"
    bad = tmp_path / "bad.csv"
    bad.write_text(header + "llama-2-7b,1,2,32,float16,False,10,1,0.3,13.0,13.5\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: PP_Map '32' has 1 stages, PP=2"):
        load_measurements(bad)
    bad.write_text(header + "llama-2-7b,1,1,32,bfloat8,False,10,1,0.3,13.0,13.5\n")
    with pytest.raises(ValueError, match="unknown DTYPE 'bfloat8'"):
        load_measurements(bad)
    bad.write_text("Model,TP\nx,1\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_measurements(bad)
    # After a blank line (which the csv reader skips) the line is still the file's.
    good = "llama-2-7b,1,1,32,float16,False,10,1,0.3,13.0,13.5\n"
    bad.write_text(header + good + "\n" + good.replace("float16", "bfloat8"))
    with pytest.raises(ValueError, match="bad.csv:4: unknown DTYPE 'bfloat8'"):
        load_measurements(bad)


def test_a_row_with_more_fields_than_the_header_is_refused_not_shifted(tmp_path):
    # A decimal comma in Memory-After-Run ("13,5"): stored, it would read 13 GiB and
    # every later column would be its neighbour's.
    header = "Model,TP,PP,PP_Map,DTYPE,INT8_KV_Cache,Output_Lenght,Batch_Size,Latency,Memory-Pre-Run,Memory-After-Run\n"
    bad = tmp_path / "bad.csv"
    bad.write_text(header + "llama-2-7b,1,1,32,float16,False,10,1,0.3,13.0,13,5\n")
    with pytest.raises(
        ValueError,
        match=r"bad.csv:2: 12 fields, the header has 11 columns \(beyond them: '5'\); a decimal "
        "comma or an unquoted comma in a value shifts every field after it",
    ):
        load_measurements(bad)


def test_llama_2_7b_references_land_near_the_measured_full_model(data):
    latency, memory = {}, {}
    for r in data.fingerprints:
        if r.model == "llama-2-7b" and (r.tp, r.pp) in ((1, 1), (2, 1), (1, 2)):
            key = (r.variant, (r.tp, r.pp))
            latency.setdefault(key, []).append(
                LatencySample(r.layers, r.latency_s, r.output_tokens)
            )
            layers, gib = memory.setdefault(key, ([], []))
            layers.append(r.layers)
            gib.append(r.memory_gib)
    profiles = extrapolate_references(32, latency, memory)
    fp16 = profiles[("llama-2-7b", "fp16", False)]
    full = {
        (r.tp, r.pp, r.output_tokens): r
        for r in data.full_models
        if r.variant == ("llama-2-7b", "fp16", False)
    }
    for i, (tp, pp) in enumerate(fp16.layouts):
        measured = full[(tp, pp, 100)]
        assert fp16.latency_s(100)[i] == pytest.approx(measured.latency_s, rel=0.08)
        assert fp16.memory_gib[i] == pytest.approx(measured.memory_gib, rel=0.03)
    assert np.isfinite(fp16.ttft_s).all()
