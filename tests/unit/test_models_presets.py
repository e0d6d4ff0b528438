"""Shape presets: exact published shapes, streamed checkpoint writing, ``iserve model create``."""

from __future__ import annotations

import shutil
import tracemalloc
from pathlib import Path

import pytest

from services.cli.main import main as cli_main
from services.models.checkpoint import read_config, validate_checkpoint
from services.models.families import parse_config
from services.models.presets import (
    PRESETS,
    create_preset_checkpoint,
    find_preset,
    get_preset,
    preset_config,
)
from services.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE

# Published parameter counts. Llama, Code Llama, Mistral, Qwen2 and Qwen2.5: transformers'
# num_parameters() of the released checkpoints (their authors round them to 7B, 13B, 70B,
# 8B, 70B, 34B, 7.3B, 7.6B, 72.7B, 14.7B, 32.5B); GPT-J:
# its model card; Falcon: num_parameters() of the released configs, whose LM head is tied
# to the embeddings and so counted once (TII rounds them to 7B and 40B).
PUBLISHED_PARAMETERS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "codellama-34b": 33_743_970_304,
    "qwen2-72b": 72_706_203_648,
    "mistral-7b": 7_241_732_096,
    "qwen2-7b": 7_615_616_512,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
    "falcon-7b": 6_921_720_704,
    "falcon-40b": 41_303_293_952,
    "gpt-j-6b": 6_053_381_344,
}


def test_every_preset_has_a_published_count() -> None:
    assert set(PRESETS) == set(PUBLISHED_PARAMETERS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_parameter_count_matches_published(name: str) -> None:
    count = get_preset(name).spec.parameter_count()
    assert count == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.005)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_shapes_equal_transformers_model(name: str) -> None:
    """The full-size model transformers builds from the preset (on the meta device, no
    memory) has exactly the tensors ArchSpec expects."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = dict(get_preset(name).config)
    spec = parse_config(config)
    hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    hf_tensors = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    if spec.tie_word_embeddings:
        hf_tensors.pop("lm_head.weight", None)
    assert spec.expected_tensors() == hf_tensors
    assert spec.parameter_count() == model.num_parameters()


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("llama-2-70b", "llama-2-70b"),
        ("Llama-2-70B", "llama-2-70b"),
        ("meta-llama/Llama-2-70b-hf", "llama-2-70b"),
        ("Llama-2-70b-hf", "llama-2-70b"),
        (" Meta-Llama-3-70B ", "llama-3-70b"),
        ("Qwen/Qwen2-72B", "qwen2-72b"),
        ("EleutherAI/gpt-j-6b", "gpt-j-6b"),
        ("tiiuae/falcon-40b", "falcon-40b"),
        ("mistralai/Mistral-7B-v0.1", "mistral-7b"),
        ("meta-llama/Llama-3.1-70B", "llama-3.1-70b"),
        ("Llama-3.1-8B", "llama-3.1-8b"),
        ("Meta-Llama-3.1-8B", "llama-3.1-8b"),
        ("meta-llama/Meta-Llama-3.1-70B", "llama-3.1-70b"),
        ("Qwen/Qwen2.5-14B", "qwen2.5-14b"),
        ("qwen2.5-32b", "qwen2.5-32b"),
        ("llama-2-70", None),
        ("llama-2-70b-chat", None),
        ("", None),
    ],
)
def test_find_preset_reads_names_and_repositories_in_any_case(name, preset) -> None:
    assert find_preset(name) == preset


def test_preset_config_changes_layers_and_dtype() -> None:
    config = preset_config("gpt-j-6b", num_layers=2, dtype="bfloat16")
    assert (config["n_layer"], config["torch_dtype"]) == (2, "bfloat16")
    spec = parse_config(preset_config("llama-2-70b", num_layers=1))
    assert (spec.num_layers, spec.hidden_size, spec.num_kv_heads) == (1, 8192, 8)
    with pytest.raises(KeyError, match="known presets"):
        get_preset("llama-1-7b")
    with pytest.raises(ValueError, match="int8"):
        preset_config("falcon-7b", dtype="int8")


@pytest.mark.parametrize("name", ["falcon-7b", "gpt-j-6b"])
def test_one_layer_preset_checkpoint_validates(name: str, tmp_path: Path) -> None:
    """Real widths and vocabulary, one layer, bf16 (about 1 GB, removed afterwards)."""
    out = create_preset_checkpoint(tmp_path / name, name, num_layers=1, dtype="bfloat16")
    try:
        checked = validate_checkpoint(out)
        spec = checked.spec
        full = get_preset(name).spec
        assert spec.num_layers == 1
        assert (spec.hidden_size, spec.vocab_size, spec.num_kv_heads) == (
            full.hidden_size,
            full.vocab_size,
            full.num_kv_heads,
        )
        assert {info.dtype for info in checked.tensors.values()} == {"BF16"}
        assert checked.weight_bytes == 2 * spec.parameter_count()
        # The small test tokenizer's ids sit inside the real vocabulary.
        assert (spec.bos_token_id, spec.eos_token_ids) == (BOS_TOKEN_ID, (EOS_TOKEN_ID,))
        assert spec.vocab_size >= VOCAB_SIZE
    finally:
        shutil.rmtree(out)


def test_cli_preset_streams_without_holding_the_model(tmp_path: Path, capsys) -> None:
    """`iserve model create --preset llama-2-7b --layers 2` at bf16 writes 1.3 GB while
    the Python heap peaks at a small fraction of it."""
    out = tmp_path / "llama2"
    argv = ["model", "create", "l2", "--preset", "llama-2-7b", "--layers", "2"]
    tracemalloc.start()
    try:
        status = cli_main([*argv, "--dtype", "bfloat16", "--out", str(out)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        assert status == 0
        checked = validate_checkpoint(out)
        assert checked.spec.num_layers == 2 and checked.spec.hidden_size == 4096
        assert checked.weight_bytes > 1.2 * 2**30
        assert peak < checked.weight_bytes / 10
        assert "llama, 2 layers" in capsys.readouterr().out
        assert read_config(out)["vocab_size"] == 32000
    finally:
        shutil.rmtree(out)


def test_cli_custom_shape_for_every_family(tmp_path: Path, capsys) -> None:
    for arch in ("llama", "mistral", "qwen2", "falcon", "gptj"):
        out = tmp_path / arch
        argv = ["model", "create", arch, "--arch", arch, "--hidden", "32", "--layers", "1"]
        assert cli_main([*argv, "--heads", "4", "--out", str(out)]) == 0
        assert validate_checkpoint(out).spec.family == arch
    assert "gptj, 1 layer," in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--preset", "falcon-7b", "--hidden", "64"], "drop --hidden"),
        (["--preset", "falcon-7b", "--arch", "falcon"], "drop --arch"),
        (["--preset", "llama-1-7b"], "unknown preset 'llama-1-7b'"),
        (["--hidden", "64", "--heads", "4"], "--layers missing"),
        (
            [
                "--arch",
                "gptj",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--layers",
                "1",
                "--kv-heads",
                "2",
            ],
            "one KV head per query head",
        ),
    ],
)
def test_cli_model_create_errors(tmp_path: Path, capsys, extra: list[str], message: str) -> None:
    argv = ["model", "create", "bad", *extra, "--out", str(tmp_path / "bad")]
    if message in ("one KV head per query head",):  # a shape the family cannot have
        assert cli_main(argv) == 1
    else:  # flags that do not go together, missing or unknown: usage errors, as argparse's
        with pytest.raises(SystemExit) as exited:
            cli_main(argv)
        assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_cli_model_create_into_a_non_empty_directory_names_force(tmp_path: Path, capsys) -> None:
    out = tmp_path / "full"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    argv = ["model", "create", "m", "--hidden", "32", "--layers", "1", "--heads", "4"]
    assert cli_main([*argv, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "is not empty; give --force to replace it" in err and "overwrite=True" not in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert cli_main([*argv, "--out", str(out), "--force"]) == 0
