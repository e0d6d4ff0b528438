"""ImportProfiles: MaverIQ files from bytes to model records and profiles."""

from __future__ import annotations

import json
import math

import pytest

from fingerprint_svc.importing import (
    import_profiles,
    merge_model,
    merge_profile,
    plan_maveriq_import,
)
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.auth import access, policy
from services.auth.tokens import Principal
from services.errors import AlreadyExists, FailedPrecondition, InvalidArgument, PermissionDenied
from services.estimation.memory import GIB
from services.models.errors import UnsupportedArchitecture, engine_cannot_run, shape_only
from services.models.families import parse_config
from services.state.store import StateStore

HEADER = (
    "Model,TP,PP,PP_Map,DTYPE,INT8_KV_Cache,Output_Lenght,Batch_Size,Latency,"
    "Memory-Pre-Run,Memory-After-Run,Time-Gen-Graph,Time-Prof\n"
)
FINGERPRINTS = HEADER + (
    "llama-2-7b,1,1,1,float16,False,10,1,0.05,1.2,1.25,10,5\n"
    "llama-2-7b,1,1,2,float16,False,10,1,0.07,1.6,1.75,10,5\n"
    "llama-2-7b,2,1,1,int4,True,20,1,0.06,2.2,2.5,10,5\n"
    "llama-2-7b,1,2,1 1,float16,False,10,1,0.08,2.2,2.5,10,5\n"
    "gtpj-6b,1,1,1,int8,False,10,1,0.04,1.0,1.1,10,5\n"
)
FULL = HEADER + "llama-2-7b,2,4,8 8 8 8,float16,False,100,1,3.5,16,16.5,10,5\n"
BATCH = HEADER + "llama-2-7b,1,1,1,float16,False,10,2,0.05,1.2,1.25,10,5\n"
PRUNED = HEADER + "llama-2-7b-wanda,1,1,32,float16,False,10,1,0.3,13,13.5,10,5\n"
ACCURACY = json.dumps({"llama-2-7b_int4_True_None": 87.1, "gtpj-6b_int8_False_None": 99.2})
DATA_SET = {
    "fingerprint_data_collection.csv": FINGERPRINTS,
    "fingerprint_data_collection_BS.csv": BATCH,
    "full_model_data_collection.csv": FULL,
    "full_model_data_collection_pruning.csv": PRUNED,
    "MS_model_acc_MMLU.json": ACCURACY,
}


def plan(named: dict[str, str], hardware_type: str = "rtx-a6000"):
    return plan_maveriq_import(
        [(name, text.encode()) for name, text in named.items()], hardware_type
    )


def test_rows_become_measurements_of_shape_only_preset_models():
    result = plan(DATA_SET)
    models = {m.model_id: m for m in result.models}
    assert sorted(models) == ["gptj-6b", "llama-2-7b"]
    assert result.measurement_count == 7
    llama = models["llama-2-7b"]
    assert llama.shape.num_layers == 32 and llama.shape.num_attention_heads == 32
    assert llama.shape.dtype == common.PRECISION_FLOAT16
    assert models["gptj-6b"].shape_source == "preset gpt-j-6b"
    assert models["gptj-6b"].shape.num_layers == 28
    assert [v.name for v in llama.variants] == ["fp16", "int4-kv8"]
    int4 = llama.variants[1]
    assert int4.weight_quant == common.WEIGHT_QUANT_INT4 and int4.kv_quant == common.KV_QUANT_INT8
    assert int4.accuracy_score == 87.1 and not llama.variants[0].HasField("accuracy_score")
    assert models["gptj-6b"].variants[0].accuracy_score == 99.2  # "gtpj" in the source

    rows = llama.measurements
    fingerprint = rows[0]
    (full,) = [m for m in rows if m.full_model]
    (batch2,) = [m for m in rows if m.config.batch_size == 2]
    assert not fingerprint.full_model and fingerprint.num_layers == 1
    assert fingerprint.input_tokens == 923 and fingerprint.latency_ms == pytest.approx(50)
    assert fingerprint.ttft_ms == 0 and fingerprint.repetitions == 3
    assert fingerprint.hardware_type == "rtx-a6000"
    assert full.full_model and list(full.stage_layers) == [8, 8, 8, 8]
    assert full.config.tensor_parallel == 2 and full.config.pipeline_parallel == 4
    # Memory summed over the GPUs, split evenly over the 8 ranks.
    assert len(full.peak_memory_bytes_per_rank) == 8
    assert sum(full.peak_memory_bytes_per_rank) == pytest.approx(16.5 * GIB, abs=8)
    assert batch2.input_tokens == 0 and batch2.config.batch_size == 2  # prompt not recorded
    assert any("full_model_data_collection_pruning.csv" in s for s in result.skipped)


def test_unknown_files_and_models_are_skipped_with_a_reason():
    result = plan(
        {
            "notes.csv": "x",
            "fingerprint_data_collection.csv": FINGERPRINTS.replace("gtpj-6b", "mystery-1b"),
        }
    )
    assert any(s.startswith("notes.csv: not a file of MaverIQ's data set") for s in result.skipped)
    assert any(s.startswith("mystery-1b: 1 rows; no architecture preset") for s in result.skipped)
    assert any("--model-config mystery-1b=PATH" in s for s in result.skipped)
    assert [m.model_id for m in result.models] == ["llama-2-7b"]
    # A name no model id can be: the --model-config hint would be refused; say so.
    wide = "\uff2c\uff4c\uff41\uff4d\uff41-9b"  # full-width letters
    result = plan({"fingerprint_data_collection.csv": FINGERPRINTS.replace("gtpj-6b", wide)})
    (skip,) = [s for s in result.skipped if s.startswith(wide)]
    assert "--model-config" not in skip
    assert skip.endswith(
        "the name cannot be a model id (use 1-64 lowercase letters, digits, "
        "'.', '_' or '-', starting with a letter or digit): rename it in the file)"
    )


def test_names_in_any_spelling_denote_their_preset_and_pruning_only_its_methods():
    rows = [
        "Llama-2-70B,1,1,1,float16,False,10,1,0.05,3.0,3.1",
        "meta-llama/Llama-2-70b-hf,1,1,2,float16,False,10,1,0.07,4.4,4.5",
        "Llama-2-7b-hf,1,1,1,int8,False,10,1,0.04,1.0,1.1",
        "Meta-Llama-3-70B,1,1,1,float16,False,10,1,0.05,5.8,5.9",
        "Llama-2-7B-SparseGPT,1,1,32,float16,False,10,1,0.3,13,13.5",
    ]
    result = plan({"fingerprint_data_collection.csv": HEADER + "\n".join(rows) + "\n"})
    models = {m.model_id: m for m in result.models}
    assert sorted(models) == ["llama-2-70b", "llama-2-7b-hf", "meta-llama-3-70b"]
    assert len(models["llama-2-70b"].measurements) == 2  # two spellings, one model
    assert models["llama-2-70b"].shape_source == "preset llama-2-70b"
    assert models["llama-2-7b-hf"].shape_source == "preset llama-2-7b"
    llama3 = models["meta-llama-3-70b"]
    assert llama3.shape_source == "preset llama-3-70b"
    assert (llama3.shape.vocab_size, llama3.shape.num_layers) == (128256, 80)
    assert "Llama-2-7B-SparseGPT: 1 rows of a pruned variant (no fingerprints); not imported" in (
        result.skipped
    )
    assert "meta-llama/Llama-2-70b-hf: rows stored under model id 'llama-2-70b'" in result.notes
    assert "Llama-2-70B: rows stored under model id 'llama-2-70b'" in result.notes


# A model of no preset: Llama's layout at 1024 wide, 24 layers, grouped-query attention.
MYSTERY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def test_a_given_config_json_shapes_a_model_no_preset_knows_and_overrides_a_preset():
    named = {"fingerprint_data_collection.csv": FINGERPRINTS.replace("gtpj-6b", "Mystery-1B")}
    configs = {"Mystery-1B": json.dumps(MYSTERY_CONFIG)}
    result = plan_maveriq_import([(n, t.encode()) for n, t in named.items()], "rtx-a6000", configs)
    models = {m.model_id: m for m in result.models}
    mystery = models["mystery-1b"]
    assert mystery.shape_source == "config.json given with the import"
    shape = mystery.shape
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (24, 1024, 4)
    assert shape.dtype == common.PRECISION_FLOAT16  # MaverIQ ran float16, whatever it says
    # KV bytes per token and layer follow from the given shape: 2 * 4 heads * 64 * 2 bytes.
    assert mystery.measurements[0].layer_kv_bytes_per_token == 2 * 4 * 64 * 2
    assert not result.skipped

    wider = dict(MYSTERY_CONFIG, num_hidden_layers=32, hidden_size=2048, num_attention_heads=16)
    result = plan_maveriq_import(
        [(n, t.encode()) for n, t in DATA_SET.items()],
        "rtx-a6000",
        {"LLAMA-2-7B": json.dumps(wider)},
    )
    llama = {m.model_id: m for m in result.models}["llama-2-7b"]
    assert llama.shape.hidden_size == 2048 and llama.shape_source.startswith("config.json")


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            ["rope_scaling type 'yarn' is not supported"],
        ),
        (
            {"hidden_act": "gelu", "quantization_config": {"quant_method": "gptq", "bits": 4}},
            ["pre-quantized checkpoints", "hidden_act 'gelu'"],
        ),
        (
            {
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "max_window_layers": 12,
                "partial_rotary_factor": 0.5,
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            },
            ["use_sliding_window: true", "partial rotary"],
        ),
    ],
)
def test_what_the_engine_cannot_run_is_a_note_on_an_import(changes, says):
    # An imported model is estimated, never run: a feature iserve's engine lacks does not
    # change its shape, so the import reads the shape and says what it set aside (once
    # each, though a RoPE block is read twice), where registration refuses it.
    config = {**MYSTERY_CONFIG, **changes}
    named = {"fingerprint_data_collection.csv": FINGERPRINTS.replace("gtpj-6b", "Mystery-1B")}
    result = plan_maveriq_import(
        [(n, t.encode()) for n, t in named.items()],
        "rtx-a6000",
        {"Mystery-1B": json.dumps(config)},
    )
    shape = {m.model_id: m for m in result.models}["mystery-1b"].shape
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (24, 1024, 4)
    (note,) = [n for n in result.notes if n.startswith("mystery-1b: its config.json")]
    assert "only its shape is read" in note
    for phrase in says:
        assert note.count(phrase) == 1, note
    with pytest.raises(UnsupportedArchitecture):
        parse_config(config)


def test_outside_an_import_the_same_features_are_refused():
    with shape_only() as notes:
        with shape_only() as inner:
            engine_cannot_run("a")
        engine_cannot_run("b")
        engine_cannot_run("b")
    assert (inner, notes) == (["a"], ["b"])
    with pytest.raises(UnsupportedArchitecture, match="c"):
        engine_cannot_run("c")


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ({"llama-2-7b": "{"}, "llama-2-7b: its config.json is not JSON"),
        # INTERNAL, a RecursionError (a tester).
        (
            {"llama-2-7b": "[" * 100_000 + "]" * 100_000},
            "llama-2-7b: its config.json is not JSON .nested too deeply",
        ),
        # What changes the shape, or is no family iserve reads, is still refused.
        (
            {"llama-2-7b": json.dumps({**MYSTERY_CONFIG, "model_type": "mixtral"})},
            "llama-2-7b: its config.json: model_type 'mixtral' is not supported",
        ),
        # Mixtral's experts under a llama model_type: imported as a dense 7B (a probe).
        (
            {
                "llama-2-7b": json.dumps(
                    {**MYSTERY_CONFIG, "num_local_experts": 8, "num_experts_per_tok": 2}
                )
            },
            "llama-2-7b: its config.json: a mixture-of-experts config .num_local_experts 8.",
        ),
        ({"llama-2-7b": "[1, 2]"}, "llama-2-7b: its config.json must be a JSON object"),
        ({"nobody-1b": "{}"}, "a config.json is given for 'nobody-1b', which no row names"),
        (
            {"llama-2-7b": json.dumps({"model_type": "bert", "architectures": ["BertModel"]})},
            "llama-2-7b: its config.json: ",
        ),
        (
            {"llama-2-7b": json.dumps(dict(MYSTERY_CONFIG, hidden_size=1000))},
            "llama-2-7b: its config.json: ",
        ),
        # JSON's 10**400 in a float field: no float holds it.
        (
            {"llama-2-7b": json.dumps(dict(MYSTERY_CONFIG, rope_theta=10**400))},
            "llama-2-7b: its config.json: config field 'rope_theta' must be a positive finite",
        ),
        # One model named in two cases: one config was dropped in silence.
        (
            {
                "LLAMA-2-7B": json.dumps(MYSTERY_CONFIG),
                "llama-2-7b": json.dumps(dict(MYSTERY_CONFIG, num_hidden_layers=48)),
            },
            "config.json texts are given for 'LLAMA-2-7B', 'llama-2-7b', one model",
        ),
        # The rows hold a 2-layer fingerprint of a model the config gives 1 layer.
        (
            {"llama-2-7b": json.dumps(dict(MYSTERY_CONFIG, num_hidden_layers=1))},
            "fingerprint_data_collection.csv:3: llama-2-7b: the row holds 2 layers, the model has 1",
        ),
    ],
)
def test_bad_model_configs_are_invalid_argument(configs, message):
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[")):
        plan_maveriq_import([(n, t.encode()) for n, t in DATA_SET.items()], "rtx-a6000", configs)


def test_a_config_for_a_name_that_is_no_model_id_or_two_shapes_for_one_id_are_refused():
    rows = HEADER + "My Model,1,1,1,float16,False,10,1,0.05,3.0,3.1\n"
    with pytest.raises(InvalidArgument, match="invalid model_id 'my model'"):
        plan_maveriq_import(
            [("fingerprint_data_collection.csv", rows.encode())],
            "rtx-a6000",
            {"My Model": json.dumps(MYSTERY_CONFIG)},
        )
    rows = HEADER + (
        "meta-llama/Llama-2-70b-hf,1,1,1,float16,False,10,1,0.05,3.0,3.1\n"
        "llama-2-70b,1,1,1,float16,False,10,1,0.05,3.0,3.1\n"
    )
    with pytest.raises(InvalidArgument, match="two names with different shapes"):
        plan_maveriq_import(
            [("fingerprint_data_collection.csv", rows.encode())],
            "rtx-a6000",
            {"llama-2-70b": json.dumps(MYSTERY_CONFIG)},
        )


@pytest.mark.parametrize(
    ("named", "message"),
    [
        (
            {"full_model_data_collection.csv": FULL.replace("3.5", "fast")},
            "full_model_data_collection.csv:2: Latency must be a number, got 'fast'",
        ),
        # Conversions name their column (Python's own messages named none), and a quoted
        # decimal comma says what it is.
        (
            {"full_model_data_collection.csv": FULL.replace(",16.5,", ',"16,5",')},
            "full_model_data_collection.csv:2: Memory-After-Run must be a number, got "
            "'16,5' (a decimal comma: write 16.5)",
        ),
        (
            {"full_model_data_collection.csv": FULL.replace(",100,1,", ",100,one,")},
            "full_model_data_collection.csv:2: Batch_Size must be a whole number, got 'one'",
        ),
        (
            {"full_model_data_collection.csv": FULL.replace("8 8 8 8", "8 8 8 8.0")},
            "full_model_data_collection.csv:2: PP_Map must be a whole number, got '8.0'",
        ),
        (
            {"full_model_data_collection.csv": FULL.replace("llama-2-7b,2,", "llama-2-7b,two,")},
            "full_model_data_collection.csv:2: TP must be a whole number, got 'two'",
        ),
        (
            {"fingerprint_data_collection.csv": FINGERPRINTS.replace("1 1,float16", "1,float16")},
            "fingerprint_data_collection.csv:5: PP_Map '1' has 1 stages, PP=2",
        ),
        (
            {"fingerprint_data_collection.csv": FINGERPRINTS + "llama-2-7b,1,1\n"},
            "fingerprint_data_collection.csv:7: no value for",
        ),
        ({"full_model_data_collection.csv": "Model,TP\n"}, "missing columns PP, PP_Map"),
        # A column named twice: the last copy was read, silently (a probe).
        (
            {
                "full_model_data_collection.csv": HEADER.replace("\n", ",Memory-After-Run\n")
                + "llama-2-7b,2,4,8 8 8 8,float16,False,100,1,3.5,16,16.5,10,5,33\n"
            },
            "full_model_data_collection.csv:1: the header names a column more than once: "
            "Memory-After-Run (columns 11, 14)",
        ),
        # Python reads "0_01854" as 1854 (digit separators): no CSV means that.
        (
            {"full_model_data_collection.csv": FULL.replace(",3.5,", ",3_5,")},
            "full_model_data_collection.csv:2: Latency must be a number, got '3_5'",
        ),
        (
            {"full_model_data_collection.csv": FULL.replace(",100,1,", ",1_00,1,")},
            "full_model_data_collection.csv:2: Output_Lenght must be a whole number, got '1_00'",
        ),
        (
            {"full_model_data_collection.csv": HEADER.replace(",", ";") + "x;1\n"},
            "the header reads as one column: the file is separated by ';'",
        ),
        ({"full_model_data_collection.csv": HEADER.replace("Latency", "Lat")}, "columns Latency"),
        ({"MS_model_acc_MMLU.json": "{", "full_model_data_collection.csv": FULL}, "not JSON"),
        ({"MS_model_acc_MMLU.json": ACCURACY}, "no measurement file"),
        ({"full_model_data_collection.csv": HEADER}, "no measurement rows in full_model_data"),
        ({}, "no files"),
        # Values no measurement has: not finite, negative, beyond a day or a pebibyte, or
        # beyond the uint32 fields.
        *(
            (
                {"full_model_data_collection.csv": FULL.replace(",3.5,", f",{bad},")},
                "full_model_data_collection.csv:2: Latency must be a positive number of "
                f"seconds up to 86400 (a day), got {bad!r}",
            )
            for bad in ("inf", "nan", "-3.5", "0", "1e400", "1e300", "86401")
        ),
        *(
            (
                {"full_model_data_collection.csv": FULL.replace(",16.5,", f",{bad},")},
                "full_model_data_collection.csv:2: Memory-After-Run must be from 0 to "
                f"1048576 GiB (a pebibyte), got {bad!r}",
            )
            for bad in ("inf", "nan", "-1", "1e12", "1e300")
        ),
        (
            {"full_model_data_collection.csv": FULL.replace(",16,", ",-inf,")},
            "full_model_data_collection.csv:2: Memory-Pre-Run must be from 0 to",
        ),
        # Rows that cannot be runs of the model they name.
        (
            {
                "fingerprint_data_collection.csv": FINGERPRINTS.replace(
                    "llama-2-7b,2,", "llama-2-7b,3,"
                )
            },
            "fingerprint_data_collection.csv:4: llama-2-7b: TP=3 cannot be a run of this model: "
            "tensor_parallel must be one of (1, 2, 4, 8), got 3",
        ),
        (
            {
                "full_model_data_collection.csv": HEADER
                + "falcon-7b,2,1,32,float16,False,10,1,1,9,9\n"
            },
            "full_model_data_collection.csv:2: falcon-7b: TP=2 cannot be a run of this model: "
            "tensor_parallel 2 must divide the 71 attention heads",
        ),
        (
            {"full_model_data_collection.csv": FULL.replace(",100,", ",4294967295,")},
            "full_model_data_collection.csv:2: llama-2-7b: a 923-token prompt and 4294967295 "
            "output tokens pass the model's context of 4096 positions",
        ),
        (
            {"fingerprint_data_collection_BS.csv": BATCH.replace(",10,2,", ",4097,2,")},
            "fingerprint_data_collection_BS.csv:2: llama-2-7b: 4097 output tokens pass the model's",
        ),
        (
            {
                "full_model_data_collection.csv": HEADER
                + "mystery-3b,1,1,32,float16,False,10,1,1,9,9\n"
            },
            "nothing to import: mystery-3b: 1 rows; no architecture preset of that name",
        ),
        (
            {"full_model_data_collection.csv": FULL.replace(",100,", ",99999999999999999999,")},
            "full_model_data_collection.csv:2: Output_Lenght and Batch_Size must be from 1 to",
        ),
        (
            {"full_model_data_collection.csv": FULL.replace("8 8 8 8", "8 8 8 4294967296")},
            "full_model_data_collection.csv:2: TP, PP and every PP_Map stage must be from 1 to",
        ),
        *(
            (
                {
                    "MS_model_acc_MMLU.json": json.dumps({"llama-2-7b_int4_True_None": bad}),
                    "full_model_data_collection.csv": FULL,
                },
                message,
            )
            for bad, message in (
                (math.inf, "accuracy must be a finite number >= 0"),
                (math.nan, "accuracy must be a finite number >= 0"),
                (-1.0, "accuracy must be a finite number >= 0"),
                (True, "expected MODEL_DTYPE_KV_PRUNING: number"),
                # An int no float holds: refused, not an OverflowError.
                (10**400, "accuracy must be a finite number >= 0"),
            )
        ),
        # Less memory than the 32 layers' float16 weights take (12.06 GiB): no run.
        (
            {"full_model_data_collection.csv": FULL.replace(",16,16.5,", ",6,6,")},
            "full_model_data_collection.csv:2: llama-2-7b: 6 GiB of memory is less than the "
            "12.55 GiB its weights take (12.06 GiB of its 32 decoder layers in fp16, 0.49 "
            "GiB of embedding and LM head in float16)",
        ),
        # A fingerprint above its layer's weights (0.38 GiB) but below those and the
        # embedding and LM head's (0.49 GiB): taken, it stood for them in every estimate.
        (
            {
                **DATA_SET,
                "fingerprint_data_collection.csv": FINGERPRINTS.replace(",1.2,1.25,", ",0.6,0.6,"),
            },
            "fingerprint_data_collection.csv:2: llama-2-7b: 0.6 GiB of memory is less than "
            "the 0.87 GiB its weights take",
        ),
        # A row with more fields than the header: every value after the surplus comma
        # would sit under the wrong column (here the memory would read 1 GiB).
        (
            {"fingerprint_data_collection.csv": FINGERPRINTS.replace(",1.6,1.75,", ",1.6,1,75,")},
            "fingerprint_data_collection.csv:3: 14 fields, the header has 13 columns "
            "(beyond them: '5'); a decimal comma",
        ),
        # Batch sizes the estimator cannot use: every estimate of the model would fail.
        (
            {"fingerprint_data_collection_BS.csv": BATCH.replace(",10,2,", ",10,3,")},
            "fingerprint_data_collection_BS.csv:2: llama-2-7b: a fingerprint (1 of 32 layers) "
            "at batch 3; the estimator extrapolates fingerprints run at batch 1 and 2 only",
        ),
        (
            {
                "fingerprint_data_collection.csv": FINGERPRINTS.replace(
                    "llama-2-7b,1,1,2,float16,False,10,1,", "llama-2-7b,1,1,2,float16,False,10,2,"
                )
            },
            "fingerprint_data_collection.csv:3: llama-2-7b: batch 2 in a file of batch-1 runs "
            "with a 923-token prompt; runs at other batch sizes belong in "
            "fingerprint_data_collection_BS.csv",
        ),
        (
            {"full_model_data_collection.csv": FULL.replace(",100,1,", ",100,8,")},
            "full_model_data_collection.csv:2: llama-2-7b: batch 8 in a file of batch-1 runs "
            "with a 923-token prompt; runs at other batch sizes belong in "
            "full_model_data_collection_BS.csv",
        ),
        *(
            (
                {"full_model_data_collection_BS.csv": FULL.replace(",100,1,", f",100,{bad},")},
                "full_model_data_collection_BS.csv:2: Batch_Size must be at most 256, the most "
                f"sequences a deployment holds and an estimate is made for, got {bad}",
            )
            for bad in (257, 4294967295)
        ),
        # The line the csv module was reading when it failed, not the last good row's.
        (
            {
                "fingerprint_data_collection.csv": FINGERPRINTS
                + "llama-2-7b,1,1,"
                + "1" * 200_000
                + ",float16,False,10,1,0.05,1.2,1.25,10,5\n"
            },
            "fingerprint_data_collection.csv:7: field larger than field limit",
        ),
    ],
)
def test_malformed_input_is_invalid_argument_naming_file_and_line(named, message):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(named)


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("llama\x00-2-7b", "'llama\\x00-2-7b'"),
        ('"llama\n-2-7b"', "'llama\\n-2-7b'"),
        ("m" * 100_000, "'" + "m" * 76 + "... (100000 characters)"),
    ],
)
def test_a_model_name_the_skipped_lists_would_carry_raw_is_refused_cut(name, shown):
    with pytest.raises(InvalidArgument) as err:
        plan({"full_model_data_collection.csv": FULL.replace("llama-2-7b", name)})
    message = str(err.value)
    assert message.startswith(f"full_model_data_collection.csv:2: Model {shown} must be printable")
    assert len(message) < 200


def test_an_import_of_many_files_is_refused_at_once_and_duplicates_found_in_linear_time():
    """A fuzzing tester's ImportProfiles of 100,000 files held the model service for
    minutes: the duplicate check was quadratic, on its event loop. At most 1,000 files
    (MaverIQ's data set has 9), and the duplicates counted, not searched for."""
    from fingerprint_svc.importing import MAX_IMPORT_FILES

    with pytest.raises(InvalidArgument, match="100000 files to import; at most 1000"):
        plan_maveriq_import([(f"f{i}.csv", b"") for i in range(100_000)], "rtx-a6000")
    files = [(f"f{i}.csv", b"") for i in range(MAX_IMPORT_FILES - 1)] + [("f0.csv", b"")]
    with pytest.raises(InvalidArgument, match="files listed twice: 'f0.csv'"):
        plan_maveriq_import(files, "rtx-a6000")


def test_an_import_stops_reading_rows_past_its_bound():
    """A tester's one file of 600,000 rows (inside the message size) was parsed whole on
    the model service's event loop, 15 s, before its refusal. Parsing stops at
    MAX_IMPORT_ROWS over all the files, naming the file and line."""
    from fingerprint_svc.importing import MAX_IMPORT_ROWS

    row = "llama-2-7b,1,1,1,float16,False,10,1,0.05,1.0,1.1,10,5\n"
    big = (HEADER + row * (MAX_IMPORT_ROWS + 1)).encode()
    with pytest.raises(InvalidArgument, match=f"csv:{MAX_IMPORT_ROWS + 2}: more than 100,000 rows"):
        plan_maveriq_import([("fingerprint_data_collection.csv", big)], "rtx-a6000")
    # The bound is over the files together.
    half = (HEADER + row * (MAX_IMPORT_ROWS // 2 + 1)).encode()
    files = [("fingerprint_data_collection.csv", half), ("full_model_data_collection.csv", half)]
    with pytest.raises(InvalidArgument, match="full_model_data_collection.csv:.*more than"):
        plan_maveriq_import(files, "rtx-a6000")


def test_bad_bytes_names_and_hardware_types():
    with pytest.raises(InvalidArgument, match="not UTF-8"):
        plan_maveriq_import([("full_model_data_collection.csv", b"\xff\xfe")], "rtx-a6000")
    # The line, as an editor numbers it (CRLF as MaverIQ's files end them), not only the
    # byte 59958 of a 2,000-line file.
    latin1 = (FULL.replace("\n", "\r\n") + "llama-2-7b caf\xe9,1\r\n").encode("latin-1")
    with pytest.raises(InvalidArgument) as refused:
        plan_maveriq_import([("full_model_data_collection.csv", latin1)], "rtx-a6000")
    assert str(refused.value).startswith(
        "full_model_data_collection.csv:3: not UTF-8 text (byte "
    ), str(refused.value)
    with pytest.raises(InvalidArgument, match="listed twice"):
        plan_maveriq_import([("full_model_data_collection.csv", FULL.encode())] * 2, "rtx-a6000")
    with pytest.raises(InvalidArgument, match="hardware_type"):
        plan(DATA_SET, hardware_type="")
    with pytest.raises(InvalidArgument, match="hardware_type"):
        plan(DATA_SET, hardware_type="a:b")
    # Refused names come back cut to a readable length, not whole (docs/security.md).
    long = "x" * 10_000
    for files, configs in (
        ([(f"{long}/a.csv", b"")], {}),
        ([(long, b"")] * 2, {}),
        ([("full_model_data_collection.csv", FULL.encode())], {long: "{}"}),
    ):
        with pytest.raises(InvalidArgument, match=r"'xxx.*\(1000\d characters\)") as cut:
            plan_maveriq_import(files, "rtx-a6000", configs)
        assert len(str(cut.value)) < 300


def test_merge_keeps_other_hardware_and_replaces_this_one():
    old_cpu = model_pb.ProfileMeasurement(variant_name="", hardware_type="cpu-x86_64")
    old_gpu = model_pb.ProfileMeasurement(variant_name="fp16", hardware_type="rtx-a6000")
    existing = model_pb.GetProfileResponse(
        request_id="r", model_id="m", measurements=[old_cpu, old_gpu]
    )
    new = model_pb.ProfileMeasurement(variant_name="int8", hardware_type="rtx-a6000")
    merged = merge_profile(existing, "m", "rtx-a6000", [new])
    assert [m.variant_name for m in merged.measurements] == ["", "int8"]
    assert merged.request_id == ""


def test_merge_model_adds_variants_and_refuses_another_shape():
    imported = {m.model_id: m for m in plan(DATA_SET).models}["llama-2-7b"]
    created = merge_model(None, imported, now_ms=5)
    assert created.state == model_pb.MODEL_STATE_PROFILED and created.checkpoint_path == ""
    assert created.created_at_unix_ms == 5

    registered = model_pb.Model(model_id="llama-2-7b", checkpoint_path="ckpt")
    registered.shape.CopyFrom(imported.shape)
    registered.state = model_pb.MODEL_STATE_REGISTERED
    registered.variants.add(name="int4-kv8", weight_quant=common.WEIGHT_QUANT_INT4)
    merged = merge_model(registered, imported, now_ms=5)
    assert merged.state == model_pb.MODEL_STATE_REGISTERED and merged.checkpoint_path == "ckpt"
    assert [v.name for v in merged.variants] == ["int4-kv8", "fp16"]
    assert merged.variants[0].accuracy_score == 87.1

    tiny = model_pb.Model(model_id="llama-2-7b", checkpoint_path="tiny")
    tiny.shape.CopyFrom(imported.shape)
    tiny.shape.num_layers, tiny.shape.num_kv_heads = 2, 8
    with pytest.raises(
        InvalidArgument,
        match="registered checkpoint of another shape than the imported rows' model "
        r"\(num_layers 2 -> 32; num_kv_heads 8 -> 32\)",
    ):
        merge_model(tiny, imported, now_ms=5)

    # A shape-only record takes a corrected shape when none of its rows stays.
    shape_only = model_pb.Model(model_id="llama-2-7b")
    shape_only.shape.CopyFrom(tiny.shape)
    assert merge_model(shape_only, imported, now_ms=5).shape == imported.shape
    with pytest.raises(InvalidArgument, match="3 of its rows come from files or hardware"):
        merge_model(shape_only, imported, now_ms=5, kept_rows=3)


# ---- against a real redis-server ---------------------------------------------------------
def request(named: dict[str, str], hardware_type: str = "rtx-a6000", **fields):
    fields.setdefault("format", model_pb.PROFILE_FORMAT_MAVERIQ)
    return model_pb.ImportProfilesRequest(
        request_id="r1",
        hardware_type=hardware_type,
        files=[model_pb.ProfileFile(name=n, content=t.encode()) for n, t in named.items()],
        **fields,
    )


def test_import_refuses_a_new_model_whose_id_is_a_deployments_and_writes_nothing(run):
    """A model of a deployment's id took that deployment's requests (the id names the
    model first): importing rows into such an id, as registering one, is refused."""
    from services.api import deployment_service_pb2 as deploy_pb

    async def scenario(store: StateStore):
        await store.put_deployment(deploy_pb.Deployment(deployment_id="llama-2-7b", model_id="x"))
        with pytest.raises(AlreadyExists, match="'llama-2-7b' is a deployment's id"):
            await import_profiles(store, request(DATA_SET))
        assert await store.list_models() == []  # not even gptj-6b, listed first
        assert await store.get_profile("gptj-6b") is None
        # The deployer draws around both kinds of id.
        assert not await store.deployment_id_is_free("llama-2-7b")
        assert await store.deployment_id_is_free("llama-2-7b-0badf00d")

    run(scenario)


def test_import_stores_models_profiles_and_sources_and_reimport_replaces(run):
    async def scenario(store: StateStore):
        reply = await import_profiles(store, request(DATA_SET))
        assert list(reply.model_ids) == ["gptj-6b", "llama-2-7b"]
        assert reply.measurements_imported == 7 and reply.request_id == "r1"
        assert [m.model_id for m in await store.list_models()] == ["gptj-6b", "llama-2-7b"]
        profile = await store.get_profile("llama-2-7b")
        assert len(profile.measurements) == 6
        source = json.loads((await store.get_profile_sources("llama-2-7b"))["rtx-a6000"])
        assert source["format"] == "maveriq"
        assert "fingerprint_data_collection.csv" in source["files"]

        # Another hardware type adds rows; a file imported again replaces its own rows and
        # keeps the other files'.
        before = sorted(m.SerializeToString() for m in profile.measurements)
        await import_profiles(store, request({"full_model_data_collection.csv": FULL}, "h100"))
        await import_profiles(store, request({"full_model_data_collection.csv": FULL}, "rtx-a6000"))
        rows = (await store.get_profile("llama-2-7b")).measurements
        assert [m.source_file for m in rows if m.hardware_type == "h100"] == [
            "full_model_data_collection.csv"
        ]
        a6000 = [m for m in rows if m.hardware_type == "rtx-a6000"]
        assert sorted(m.SerializeToString() for m in a6000) == before
        model = await store.get_model("llama-2-7b")
        assert [v.name for v in model.variants] == ["fp16", "int4-kv8"]

    run(scenario)


def test_a_file_imported_again_with_fewer_rows_says_so(run):
    """A copy cut short replaced the whole file's rows of its models without a word (a
    tester: `head -n 300` of the full-model file). The same file again says nothing."""

    async def scenario(store: StateStore):
        await import_profiles(store, request(DATA_SET))
        again = await import_profiles(store, request({"full_model_data_collection.csv": FULL}))
        assert not [n for n in again.notes if "replace" in n], again.notes
        cut = FINGERPRINTS.rsplit("llama-2-7b,1,2", 1)[0]  # its (1,2) rows lost
        reply = await import_profiles(store, request({"fingerprint_data_collection.csv": cut}))
        assert (
            "llama-2-7b: this import's 3 row(s) replace the 4 it had on rtx-a6000 from the "
            "same file(s): fewer than before; if a file was cut short, import the whole file "
            "again"
        ) in reply.notes, reply.notes

    run(scenario)


def test_files_imported_one_at_a_time_store_what_importing_them_at_once_stores(run):
    async def scenario(store: StateStore):
        await import_profiles(store, request(DATA_SET))
        at_once = {
            model_id: sorted(
                m.SerializeToString() for m in (await store.get_profile(model_id)).measurements
            )
            for model_id in ("gptj-6b", "llama-2-7b")
        }
        await store.redis.flushdb()
        for name, text in DATA_SET.items():
            if name not in ("fingerprint_data_collection_BS.csv", "full_model_data_collection.csv"):
                continue
            await import_profiles(store, request({name: text}))
        await import_profiles(
            store,
            request(
                {
                    "fingerprint_data_collection.csv": FINGERPRINTS,
                    "MS_model_acc_MMLU.json": ACCURACY,
                }
            ),
        )
        for model_id, rows in at_once.items():
            profile = await store.get_profile(model_id)
            assert sorted(m.SerializeToString() for m in profile.measurements) == rows
        source = json.loads((await store.get_profile_sources("llama-2-7b"))["rtx-a6000"])
        assert source["files"] == sorted(
            n for n in DATA_SET if n != "full_model_data_collection_pruning.csv"
        )

    run(scenario)


def test_a_corrected_config_reshapes_a_model_only_when_all_its_rows_are_imported_again(run):
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    shape = dict(
        llama,
        hidden_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1024,
        vocab_size=1000,
        max_position_embeddings=2048,
    )
    fingerprints = HEADER + "mine-1b,1,1,1,float16,False,10,1,0.05,1.0,1.1,10,5\n"
    full = HEADER + "mine-1b,1,1,2,float16,False,10,1,0.09,1.5,1.6,10,5\n"

    async def scenario(store: StateStore):
        first = {"mine-1b": json.dumps(shape)}
        await import_profiles(
            store,
            request(
                {
                    "fingerprint_data_collection.csv": fingerprints,
                    "full_model_data_collection.csv": full,
                },
                model_configs=first,
            ),
        )
        corrected = {"mine-1b": json.dumps(dict(shape, num_key_value_heads=2))}
        # Rows of a file this import does not bring were measured on the old shape.
        with pytest.raises(InvalidArgument, match="1 of its rows come from files"):
            await import_profiles(
                store,
                request({"fingerprint_data_collection.csv": fingerprints}, model_configs=corrected),
            )
        assert (await store.get_model("mine-1b")).shape.num_kv_heads == 8
        reply = await import_profiles(
            store,
            request(
                {
                    "fingerprint_data_collection.csv": fingerprints,
                    "full_model_data_collection.csv": full,
                },
                model_configs=corrected,
            ),
        )
        assert any("num_kv_heads 8 -> 2" in note for note in reply.notes)
        assert (await store.get_model("mine-1b")).shape.num_kv_heads == 2
        kv = {m.layer_kv_bytes_per_token for m in (await store.get_profile("mine-1b")).measurements}
        assert kv == {2.0 * 2 * 64 * 2}

    run(scenario)


def test_bad_requests_write_nothing(run):
    async def scenario(store: StateStore):
        with pytest.raises(InvalidArgument, match="unspecified"):
            await import_profiles(
                store, request(DATA_SET, format=model_pb.PROFILE_FORMAT_UNSPECIFIED)
            )
        broken = dict(DATA_SET)
        broken["full_model_data_collection.csv"] = FULL + "llama-2-7b,2,4,8 8 8 8,float16\n"
        with pytest.raises(InvalidArgument, match="full_model_data_collection.csv:3"):
            await import_profiles(store, request(broken))
        assert await store.list_models() == []
        assert await store.get_profile("llama-2-7b") is None

        bad_config = request(DATA_SET, model_configs={"gptj-6b": "{"})
        with pytest.raises(InvalidArgument, match="gptj-6b: its config.json is not JSON"):
            await import_profiles(store, bad_config)
        assert await store.list_models() == []
        assert await store.get_profile("llama-2-7b") is None

    run(scenario)


def test_an_import_into_a_model_being_profiled_is_refused_and_writes_nothing(run):
    """The profiling job writes the whole profile when it ends: rows imported meanwhile
    were reported imported, then silently gone (a probe)."""

    async def scenario(store: StateStore):
        await import_profiles(store, request(DATA_SET))
        model = await store.get_model("llama-2-7b")
        model.state = model_pb.MODEL_STATE_PROFILING
        await store.put_model(model)
        before = await store.get_profile("llama-2-7b")
        more = {"full_model_data_collection.csv": FULL}
        with pytest.raises(FailedPrecondition, match="'llama-2-7b' is being profiled"):
            await import_profiles(store, request(more, "h100"))
        assert await store.get_profile("llama-2-7b") == before
        assert "h100" not in await store.get_profile_sources("llama-2-7b")

    run(scenario)


def test_an_import_that_would_overfill_a_profile_is_refused_and_writes_nothing(run, monkeypatch):
    """200,000 rows imported took 86 MB of JSON that every estimate then decoded (8-17 s
    each): a model's profile holds at most MAX_PROFILE_MEASUREMENTS rows, counting those
    kept from earlier imports, and an import beyond it changes nothing."""
    from services import importers

    monkeypatch.setattr(importers, "MAX_PROFILE_MEASUREMENTS", 6)

    async def scenario(store: StateStore):
        await import_profiles(store, request(DATA_SET))  # llama-2-7b: 6 rows
        more = {"full_model_data_collection.csv": FULL}
        await import_profiles(store, request(more))  # replaces its own rows: still 6
        before = await _snapshot(store)
        with pytest.raises(
            InvalidArgument,
            match=r"model 'llama-2-7b' would hold 7 measurements after this import \(1 of "
            r"them imported now\); a profile holds at most 6",
        ):
            await import_profiles(store, request(more, "h100"))
        assert await _snapshot(store) == before

    run(scenario)


def test_profiles_are_stored_compact_and_json_ones_still_read(run):
    """A profile is stored as binary protobuf (base64): protobuf's JSON parser took 0.56 s
    per 5,000 rows on every estimate. One stored as JSON by an earlier version reads."""
    from services.state import keys
    from services.state.records import encode

    async def scenario(store: StateStore):
        await import_profiles(store, request(DATA_SET))
        raw = await store.redis.get(keys.profile("llama-2-7b"))
        assert raw.startswith("pb64:")
        profile = await store.get_profile("llama-2-7b")
        assert len(profile.measurements) == 6
        await store.redis.set(keys.profile("llama-2-7b"), encode(profile))
        assert await store.get_profile("llama-2-7b") == profile

    run(scenario)


def test_a_row_the_estimator_cannot_use_leaves_a_working_model_as_it_was(run):
    async def scenario(store: StateStore):
        await import_profiles(store, request(DATA_SET))
        before = await _snapshot(store)
        bad_batch = FINGERPRINTS.replace(
            "llama-2-7b,1,1,2,float16,False,10,1,", "llama-2-7b,1,1,2,float16,False,10,3,"
        )
        shifted = FINGERPRINTS.replace(",1.6,1.75,", ",1.6,1,75,")
        for text, where in ((bad_batch, ":3: llama-2-7b: a fingerprint"), (shifted, ":3: 14")):
            with pytest.raises(InvalidArgument, match=f"fingerprint_data_collection.csv{where}"):
                await import_profiles(store, request({"fingerprint_data_collection.csv": text}))
            assert await _snapshot(store) == before
        # A full-model row of fewer layers than the model (a PP_Map slip, 8 written 1):
        # it was stored as a fingerprint, and the estimates went 12x (a tester).
        slip = FULL.replace(",2,4,8 8 8 8,", ",2,4,8 8 1 8,")
        with pytest.raises(
            InvalidArgument,
            match="full_model_data_collection.csv:2: llama-2-7b: a run in "
            "full_model_data_collection.csv holds the whole model, 32 layers, and this "
            "row's PP_Map 8:8:1:8 gives 25",
        ):
            await import_profiles(store, request({"full_model_data_collection.csv": slip}))
        assert await _snapshot(store) == before

    run(scenario)


async def _import_as(who: Principal, store: StateStore, named: dict[str, str]):
    token = access.set_caller(who)
    try:
        return await import_profiles(store, request(named))
    finally:
        access.reset_caller(token)


async def _snapshot(store: StateStore) -> dict[str, tuple]:
    """Every model record with its profile and the profile's sources."""
    found = {}
    for model in await store.list_models():
        found[model.model_id] = (
            model,
            await store.get_profile(model.model_id),
            await store.get_profile_sources(model.model_id),
        )
    return found


def test_an_import_changes_only_the_callers_models_and_owns_what_it_creates(run):
    """docs/security.md: a model developer imports profiles only for its own models; a
    model an import creates belongs to the importer; a refused import writes nothing."""
    mia = Principal("t1", "mia", policy.MODEL_DEVELOPER)
    max_ = Principal("t2", "max", policy.MODEL_DEVELOPER)
    admin = Principal("t3", "root", policy.ADMIN)
    gptj = {
        "fingerprint_data_collection.csv": HEADER + "gtpj-6b,1,1,1,int8,False,10,1,0.04,1,1,1,1\n"
    }
    llama = {"full_model_data_collection.csv": FULL}

    async def scenario(store: StateStore):
        await _import_as(mia, store, llama)
        assert (await store.get_model("llama-2-7b")).owner == "mia"
        before = await _snapshot(store)
        # gptj-6b would be new, llama-2-7b is mia's: refused whole, gptj-6b not created.
        with pytest.raises(PermissionDenied, match="model 'llama-2-7b' is owned by mia; max"):
            await _import_as(max_, store, {**gptj, "MS_model_acc_MMLU.json": ACCURACY, **llama})
        assert await _snapshot(store) == before

        await _import_as(max_, store, gptj)
        assert (await store.get_model("gptj-6b")).owner == "max"
        before = await _snapshot(store)
        with pytest.raises(PermissionDenied, match="model 'gptj-6b' is owned by max; mia"):
            await _import_as(mia, store, gptj)
        assert await _snapshot(store) == before
        await _import_as(max_, store, gptj)  # its own: imported again

        # A record with no owner (made with authentication off): administrators only.
        unowned = await store.get_model("llama-2-7b")
        unowned.owner = ""
        await store.put_model(unowned)
        with pytest.raises(PermissionDenied, match="has no owner"):
            await _import_as(mia, store, llama)
        await _import_as(admin, store, llama)
        assert (await store.get_model("llama-2-7b")).owner == ""

    run(scenario)


def test_a_model_given_by_its_config_is_stored_with_that_shape_and_a_note(run):
    async def scenario(store: StateStore):
        rows = HEADER + (
            "Mystery-1B,1,1,1,float16,False,10,1,0.05,1.0,1.1\n"
            "Mystery-1B,1,1,2,float16,False,10,1,0.07,1.2,1.3\n"
        )
        reply = await import_profiles(
            store,
            request(
                {"fingerprint_data_collection.csv": rows},
                model_configs={"Mystery-1B": json.dumps(MYSTERY_CONFIG)},
            ),
        )
        assert list(reply.model_ids) == ["mystery-1b"]
        named, unestimable = reply.notes
        assert named == "Mystery-1B: rows stored under model id 'mystery-1b'"
        # One output length per layout determines nothing yet: said, not refused (the
        # rest of a data set may come in another file).
        assert unestimable.startswith("mystery-1b: no estimates on rtx-a6000 yet: ")
        model = await store.get_model("mystery-1b")
        assert model.shape.num_layers == 24 and model.shape.hidden_size == 1024
        assert "config.json given with the import" in model.state_reason
        assert len((await store.get_profile("mystery-1b")).measurements) == 2

    run(scenario)


def test_imported_rows_carry_the_layer_bytes_their_engine_format_implies():
    """Llama-2-7B's decoder layer has 4 * 4096^2 + 3 * 4096 * 11008 + 2 * 4096 weights;
    TensorRT-LLM 0.9 holds them in float16, or int4 with a float16 scale per output
    channel; K and V of a token take 2 * 4096 elements per layer (float16, or int8)."""
    plan = plan_maveriq_import(
        [(name, text.encode()) for name, text in DATA_SET.items()], "rtx-a6000"
    )
    llama = next(m for m in plan.models if m.model_id == "llama-2-7b")
    params = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    final_norm_share = 4096 / 32  # the final norm, spread over the layers
    by_variant = {m.variant_name: m for m in llama.measurements}
    fp16, int4_kv8 = by_variant["fp16"], by_variant["int4-kv8"]
    assert fp16.layer_weight_bytes == pytest.approx(2 * (params + final_norm_share))
    assert int4_kv8.layer_weight_bytes == pytest.approx(
        (0.5 + 2 / 4096) * (params + final_norm_share)
    )
    assert fp16.layer_kv_bytes_per_token == 2 * 4096 * 2
    assert int4_kv8.layer_kv_bytes_per_token == 2 * 4096 * 1


def _estimable_rows(scale: float = 1.0, outputs: tuple[int, ...] = (10, 20)) -> str:
    """llama-2-7b fp16 fingerprints at the three references, 1 and 2 layers, enough
    for estimates: latency 0.02 s + 0.004 s a token per layer (``scale`` times it)."""
    lines = []
    for tp, pp, maps in ((1, 1, ("1", "2")), (2, 1, ("1", "2")), (1, 2, ("1 1", "1 2"))):
        for layer_map in maps:
            layers = sum(int(n) for n in layer_map.split())
            for o in outputs:
                latency = scale * (0.02 + 0.004 * o * layers / tp + 0.001 * (tp + pp))
                memory = 1.2 + 0.2 * layers
                lines.append(
                    f"llama-2-7b,{tp},{pp},{layer_map},float16,False,{o},1,{latency:.6f},"
                    f"{memory - 0.05:.3f},{memory:.3f},10,5\n"
                )
    return HEADER + "".join(lines)


def test_rows_of_one_run_that_no_measurement_gives_are_refused_naming_them():
    """One mistyped row was imported silently: 1e-300 s moved every estimate of its
    variant by a third; 80,000 s beside 0.04 s left 38 of 45 configurations out; a run
    given twice (3x apart) was averaged in."""
    rows = _estimable_rows()
    assert plan({"fingerprint_data_collection.csv": rows}).models  # the good rows pass
    lines = rows.splitlines(keepends=True)
    cases = {
        "tiny": (2, "0.102000", "1e-300", "0.062 s for 10 output tokens and 1e-300 s for 20"),
        "huge": (2, "0.102000", "80000", "0.062 s for 10 output tokens and 80000 s for 20"),
    }
    for name, (line, old, new, said) in cases.items():
        changed = lines.copy()
        # Line numbers count the header as 1: the run's rows are lines 2 and 3.
        changed[line] = changed[line].replace(old, new)
        assert changed != lines, name
        with pytest.raises(InvalidArgument) as refused:
            plan({"fingerprint_data_collection.csv": "".join(changed)})
        assert "fingerprint_data_collection.csv:2 and line 3: llama-2-7b" in str(refused.value)
        assert said in str(refused.value), (name, str(refused.value))
        assert "mistyped, or in other units" in str(refused.value)
    twice = "".join(lines) + lines[1].replace("0.062000", "0.186000")
    with pytest.raises(InvalidArgument, match=r"csv:2 and line 14: llama-2-7b: the same run"):
        plan({"fingerprint_data_collection.csv": twice})


def test_memory_in_other_units_than_gib_is_refused_naming_the_rows():
    """One row's Memory-After-Run in MiB (1405 for 1.372 GiB) was imported silently: the
    variant's (1,1) estimate went from 13.6 to 364 GiB and 12 configurations were left
    out; a whole run in MiB (both output lengths) gave 715 GiB (a probe)."""
    lines = _estimable_rows().splitlines(keepends=True)
    one = lines.copy()
    one[2] = one[2].replace(",1.400,", ",1433.6,")  # line 3: 1.4 GiB in MiB
    with pytest.raises(InvalidArgument) as refused:
        plan({"fingerprint_data_collection.csv": "".join(one)})
    said = str(refused.value)
    assert "fingerprint_data_collection.csv:2 and line 3: llama-2-7b" in said, said
    assert "1.4 GiB for 10 output tokens and 1433.6 GiB for 20" in said, said
    assert "in MiB or MB rather than GiB?" in said
    run = lines.copy()
    for line in (3, 4):  # the (1,1) two-layer run, both output lengths
        run[line] = run[line].replace(",1.600,", ",1638.4,")
    with pytest.raises(InvalidArgument) as refused:
        plan({"fingerprint_data_collection.csv": "".join(run)})
    said = str(refused.value)
    assert "1638.4 GiB per device (TP=1, PP_Map=[2]) beside" in said, said
    assert "in MiB or MB rather than GiB?" in said
    # GB for GiB (7 %) is no slip these can see, nor meant to.
    gb = "".join(line.replace(",1.600,", ",1.718,") for line in lines)
    assert plan({"fingerprint_data_collection.csv": gb}).models


def test_an_import_that_takes_a_models_estimates_away_is_refused_and_changes_nothing(run):
    """A file of one output length per run replaced a model's good rows: the import was
    accepted and every estimate then failed (FAILED_PRECONDITION). Partial data on a model
    without estimates is still taken, with a note, since the rest may come in another file."""

    async def scenario(store: StateStore):
        good = {"fingerprint_data_collection.csv": _estimable_rows()}
        reply = await import_profiles(store, request(good))
        assert not [n for n in reply.notes if "no estimates" in n]
        before = await store.get_profile("llama-2-7b")
        one_length = {"fingerprint_data_collection.csv": _estimable_rows(outputs=(10,))}
        with pytest.raises(InvalidArgument) as refused:
            await import_profiles(store, request(one_length))
        assert str(refused.value).startswith(
            "model 'llama-2-7b': its rows on rtx-a6000 give estimates now and would give "
            "none after this import (fingerprint samples do not determine"
        )
        assert str(refused.value).endswith("; nothing was imported")
        assert await store.get_profile("llama-2-7b") == before
        # On another hardware type the model has no estimates to lose: taken, and said.
        reply = await import_profiles(store, request(one_length, "h100"))
        assert [n for n in reply.notes if n.startswith("llama-2-7b: no estimates on h100 yet: ")]

    run(scenario)


def test_a_file_in_milliseconds_beside_its_twin_in_seconds_is_refused():
    """A whole file in milliseconds passes every check within the file (its rows move
    alike) and was imported: estimates 1000-2600x off. Beside its _BS twin in seconds,
    the same runs disagree 1000x."""
    seconds = _estimable_rows()
    twin = _estimable_rows(scale=0.8)  # short prompts: a little faster
    files = {"fingerprint_data_collection.csv": seconds, "fingerprint_data_collection_BS.csv": twin}
    assert plan(files).models
    milliseconds = _estimable_rows(scale=1000.0)
    with pytest.raises(InvalidArgument) as refused:
        plan({**files, "fingerprint_data_collection.csv": milliseconds})
    said = str(refused.value)
    assert said.startswith(
        "fingerprint_data_collection.csv:2 and fingerprint_data_collection_BS.csv:2: llama-2-7b"
    )
    assert "(1.25e+03x;" in said and "in other units than seconds?" in said


def test_a_file_in_milliseconds_imported_after_its_twin_in_seconds_is_refused(run):
    """The same file alone, its _BS twin imported before: the check within one import
    did not see the twin, and TTFTs came out at 50 minutes (a probe)."""

    async def scenario(store: StateStore):
        twin = {"fingerprint_data_collection_BS.csv": _estimable_rows(scale=0.8)}
        await import_profiles(store, request(twin))
        before = await store.get_profile("llama-2-7b")
        milliseconds = {"fingerprint_data_collection.csv": _estimable_rows(scale=1000.0)}
        with pytest.raises(InvalidArgument) as refused:
            await import_profiles(store, request(milliseconds))
        said = str(refused.value)
        assert said.startswith("llama-2-7b: the same run (TP=1, PP_Map=[1], 10 output tokens)")
        assert "one of them imported before (1.25e+03x;" in said
        assert said.endswith("Nothing was imported")
        assert await store.get_profile("llama-2-7b") == before
        # In seconds, it is taken; and a _BS file in milliseconds after it is refused too.
        await import_profiles(
            store, request({"fingerprint_data_collection.csv": _estimable_rows()})
        )
        with pytest.raises(InvalidArgument, match="in other units than seconds"):
            await import_profiles(
                store,
                request({"fingerprint_data_collection_BS.csv": _estimable_rows(scale=800.0)}),
            )

    run(scenario)


def test_rows_of_a_registered_checkpoint_take_its_shape_without_a_config_given(run, tmp_path):
    """Rows named as a registered model of no preset's name were skipped ("no architecture
    preset of that name, so no shape") though iserve holds its checkpoint (a probe)."""
    from fingerprint_svc.registry import build_model
    from services.models.checkpoint import create_checkpoint

    root = tmp_path / "models"
    create_checkpoint(root / "tiny-ckpt", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    rows = FINGERPRINTS.replace("llama-2-7b", "My-Tiny").replace("gtpj-6b", "My-Tiny")
    rows = "\n".join(line for line in rows.splitlines() if ",2,1,1,int4" not in line) + "\n"
    named = {"fingerprint_data_collection.csv": rows}

    async def scenario(store: StateStore):
        registered = build_model(
            model_pb.RegisterModelRequest(model_id="my-tiny", checkpoint_path="tiny-ckpt"), root
        )
        await store.create_model(registered)
        # Without the models root (as before) there is no shape: nothing is imported.
        with pytest.raises(InvalidArgument, match="My-Tiny: 4 rows; no architecture preset"):
            await import_profiles(store, request(named))
        reply = await import_profiles(store, request(named), root)
        assert list(reply.model_ids) == ["my-tiny"] and reply.measurements_imported == 4
        model = await store.get_model("my-tiny")
        assert model.checkpoint_path == "tiny-ckpt" and model.shape.num_layers == 2
        assert model.state == registered.state  # a registered model keeps its state
        profile = await store.get_profile("my-tiny")
        assert {m.hardware_type for m in profile.measurements} == {"rtx-a6000"}
        # A config given with the import still comes first, and a registered checkpoint
        # of another shape is refused, as before.
        wider = json.dumps(dict(json.loads((root / "tiny-ckpt" / "config.json").read_text()),
                                hidden_size=128))  # fmt: skip
        with pytest.raises(InvalidArgument, match="registered checkpoint of another shape"):
            await import_profiles(store, request(named, model_configs={"My-Tiny": wider}), root)
        # A checkpoint that can no longer be read says so, naming the remedy.
        (root / "tiny-ckpt" / "config.json").write_text("{not json")
        with pytest.raises(InvalidArgument, match="--model-config my-tiny=PATH"):
            await import_profiles(store, request(named), root)

    run(scenario)


def test_rows_of_a_presets_name_keep_the_preset_before_a_registered_checkpoint(run, tmp_path):
    """A tiny checkpoint registered as llama-2-7b is not given the real model's rows."""
    from fingerprint_svc.registry import build_model
    from services.models.checkpoint import create_checkpoint

    root = tmp_path / "models"
    create_checkpoint(root / "tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)

    async def scenario(store: StateStore):
        await store.create_model(
            build_model(
                model_pb.RegisterModelRequest(model_id="llama-2-7b", checkpoint_path="tiny"), root
            )
        )
        with pytest.raises(InvalidArgument, match="registered checkpoint of another shape"):
            await import_profiles(store, request(DATA_SET), root)

    run(scenario)


def test_the_accuracy_file_keeps_each_dense_variants_own_figure():
    """A pruned entry's figure replaced its dense variant's ("llama-2-7b_float16_False_
    wanda": 50 made fp16's accuracy 50; so did a "llama-2-7b-wanda" name), a key given
    twice kept the last silently, and 1e300 % made every intent pick int4 (a probe)."""
    from services.importers.maveriq import AccuracyKey, parse_accuracy

    dense = '"llama-2-7b_float16_False_None": 100, "llama-2-7b_int4_False_None": 87.1'
    fp16 = AccuracyKey("llama-2-7b", "fp16", False)
    for pruned in (
        '"llama-2-7b_float16_False_wanda": 50',
        '"llama-2-7b-wanda_float16_False_None": 40',
    ):
        table = parse_accuracy("{" + f"{dense}, {pruned}" + "}")
        assert table[fp16] == 100 and len(table) == 2
    # The same figure twice is one figure; two figures are refused, naming both keys.
    assert parse_accuracy("{" + f'{dense}, "llama-2-7b_float16_False_None": 100' + "}")[fp16] == 100
    with pytest.raises(ValueError, match="give one variant two accuracies \\(87.1 and 12\\)"):
        parse_accuracy("{" + f'{dense}, "llama-2-7b_int4_False_None": 12' + "}")
    # The reference's own figure is 100: 0 made every hardware's fp16 0 % accurate (a
    # tester); and a document nested too deeply is named, not an INTERNAL.
    for reference in (0, 12, 99.9):
        with pytest.raises(ValueError, match=f"{reference}; the figures are % of the FP16"):
            parse_accuracy('{"llama-2-7b_float16_False_None": ' + f"{reference}" + "}")
    with pytest.raises(ValueError, match="not JSON .nested too deeply"):
        parse_accuracy("[" * 100_000 + "]" * 100_000)
    # The misspelt name and the right one are one model.
    with pytest.raises(ValueError, match="'gtpj-6b_int8_False_None' and 'gptj-6b_int8_False_None'"):
        parse_accuracy('{"gtpj-6b_int8_False_None": 99.2, "gptj-6b_int8_False_None": 98}')
    for slip in ("150.5", "1e300", "8710"):
        with pytest.raises(ValueError, match="relative accuracy, at most 150"):
            parse_accuracy("{" + f'{dense}, "llama-2-7b_int8_False_None": {slip}' + "}")
    assert parse_accuracy('{"llama-2-7b_int8_False_None": 100.4}')  # past FP16 by noise
    # An array (of pairs, or empty) is no object of figures: it passed for a while.
    for array in ('[["llama-2-7b_int8_False_None", 99.8]]', "[]"):
        with pytest.raises(ValueError, match="expected an object of accuracy figures"):
            parse_accuracy(array)


@pytest.mark.parametrize("count", [8, 8.0, "8", 2, "1e1"])
def test_a_config_with_experts_is_refused_however_it_writes_their_count(count):
    """num_local_experts 8.0 or "8" under a llama model_type registered as a dense model
    (only an int was counted: a probe)."""
    with pytest.raises(UnsupportedArchitecture, match="a mixture-of-experts config"):
        parse_config({**MYSTERY_CONFIG, "num_local_experts": count})
    for dense in (1, 0, None, True, "none"):
        assert parse_config({**MYSTERY_CONFIG, "num_experts": dense}).num_layers == 24
    # DBRX's count one level down (imported as a dense model: a tester).
    with pytest.raises(UnsupportedArchitecture, match=r"config \(ffn_config.moe_num_experts"):
        parse_config({**MYSTERY_CONFIG, "ffn_config": {"moe_num_experts": count}})
    assert parse_config({**MYSTERY_CONFIG, "ffn_config": {"moe_num_experts": 1}}).num_layers == 24
