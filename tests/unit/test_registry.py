"""Registration decisions without a server."""

from __future__ import annotations

import pytest

from fingerprint_svc.registry import build_model, check_model_id
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.engine_rules import resolve_checkpoint
from services.errors import InvalidArgument
from services.ids import check_deployment_id, check_request_id
from services.models.checkpoint import create_checkpoint

SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    create_checkpoint(root / "tiny", **SHAPE)
    create_checkpoint(root / "tiny3", **{**SHAPE, "num_layers": 3})
    return root


@pytest.mark.parametrize("model_id", ["", "UPPER", "has space", "a:b", "-lead", "x" * 65])
def test_bad_model_ids(model_id):
    with pytest.raises(InvalidArgument, match="model_id"):
        check_model_id(model_id)


def test_paths_must_stay_in_the_root(root, tmp_path):
    assert resolve_checkpoint(root, "tiny") == (root / "tiny").resolve()
    assert resolve_checkpoint(root, str(root / "tiny")) == (root / "tiny").resolve()
    (root / "escape").symlink_to(tmp_path)
    for path in ["../x", str(tmp_path), "escape", ""]:
        with pytest.raises(InvalidArgument):
            resolve_checkpoint(root, path)


def test_a_file_of_the_checkpoint_given_for_it_says_so(root):
    """`iserve register x tiny/config.json`: the file is named as a file, with the
    directory to give (it said "is not a directory: it does not exist")."""
    from services.models.checkpoint import read_config

    for path, parent in (("tiny/config.json", "'tiny'"), ("tiny/model.safetensors", "'tiny'")):
        with pytest.raises(InvalidArgument) as refused:
            resolve_checkpoint(root, path)
        assert str(refused.value) == (
            f"checkpoint_path {path!r} is a file, not a directory: a checkpoint is the "
            f"directory that holds config.json and the weights; give {parent}"
        )
    with pytest.raises(ValueError, match="is a file, not a checkpoint directory"):
        read_config(root / "tiny" / "config.json")


def test_build_model_reads_the_shape(root):
    model = build_model(
        model_pb.RegisterModelRequest(model_id="tiny", checkpoint_path="tiny"), root
    )
    assert model.checkpoint_path == "tiny" and model.state == model_pb.MODEL_STATE_REGISTERED
    assert (model.shape.num_layers, model.shape.hidden_size, model.shape.num_kv_heads) == (2, 64, 2)
    assert model.shape.family == common.MODEL_FAMILY_LLAMA
    assert model.shape.parameter_count > 0 and model.shape.weight_bytes > 0


def test_variants_are_checked(root):
    def request(*variants):
        return model_pb.RegisterModelRequest(
            model_id="tiny", checkpoint_path="tiny", variants=variants
        )

    int8 = common.CompressionVariant(
        name="int8",
        weight_quant=common.WEIGHT_QUANT_INT8,
        kv_quant=common.KV_QUANT_NONE,
        pruning=common.PRUNING_NONE,
        accuracy_score=99.8,
    )
    assert build_model(request(int8), root).variants[0].accuracy_score == pytest.approx(99.8)
    with pytest.raises(InvalidArgument, match="twice"):
        build_model(request(int8, int8), root)
    with pytest.raises(InvalidArgument, match="UNSPECIFIED"):
        build_model(request(common.CompressionVariant(name="x")), root)
    other = common.CompressionVariant()
    other.CopyFrom(int8)
    other.name, other.checkpoint_path = "pruned", "tiny3"
    with pytest.raises(InvalidArgument, match="3 layers"):
        build_model(request(other), root)


def _variant(name="v", **fields) -> common.CompressionVariant:
    fields.setdefault("weight_quant", common.WEIGHT_QUANT_NONE)
    fields.setdefault("kv_quant", common.KV_QUANT_NONE)
    fields.setdefault("pruning", common.PRUNING_NONE)
    return common.CompressionVariant(name=name, **fields)


@pytest.fixture(scope="module")
def odd_root(tmp_path_factory):
    """Checkpoints whose widths some compressions cannot take."""
    root = tmp_path_factory.mktemp("odd-models")
    # hidden 36 (not a multiple of 8), MLP 96, 2 heads of 18.
    create_checkpoint(root / "h36", hidden_size=36, num_layers=2, num_heads=2, num_kv_heads=2)
    # MLP 90: not a multiple of 4.
    create_checkpoint(root / "mlp90", **{**SHAPE, "intermediate_size": 90})
    # MLP 200: a multiple of 8 but not of 16, so structured pruning keeps 150.
    create_checkpoint(root / "mlp200", **{**SHAPE, "intermediate_size": 200})
    create_checkpoint(root / "tiny", **SHAPE)
    create_checkpoint(root / "narrow", **{**SHAPE, "hidden_size": 32})
    create_checkpoint(
        root / "more-heads",
        **{**SHAPE, "num_heads": 8, "num_kv_heads": 2},
        config_overrides={"head_dim": 16},
    )
    create_checkpoint(root / "falcon", arch="falcon", **SHAPE)
    create_checkpoint(root / "slim-mlp", **{**SHAPE, "intermediate_size": 128})
    return root


def _register(root, checkpoint, *variants):
    return build_model(
        model_pb.RegisterModelRequest(
            model_id="odd", checkpoint_path=checkpoint, variants=list(variants)
        ),
        root,
    )


@pytest.mark.parametrize(
    ("checkpoint", "variant", "reason"),
    [
        (
            "h36",
            _variant("int4", weight_quant=common.WEIGHT_QUANT_INT4),
            "int4 weight quantization needs every projection's input width divisible by 8; "
            "the hidden_size is 36",
        ),
        (
            "mlp90",
            _variant("sparse", pruning=common.PRUNING_SEMI_STRUCTURED_2_4),
            "2:4 pruning needs every projection's input width divisible by 4; the MLP width is 90",
        ),
        (
            "mlp200",
            _variant(
                "pruned-int4",
                weight_quant=common.WEIGHT_QUANT_INT4,
                pruning=common.PRUNING_STRUCTURED,
            ),
            "the MLP width after structured pruning of 0.25 is 150",
        ),
        (
            "tiny",
            _variant("half", structured_prune_fraction=0.25),
            "structured_prune_fraction is set but pruning is not PRUNING_STRUCTURED",
        ),
        ("tiny", _variant("narrow", checkpoint_path="narrow"), "hidden_size 32, the model has 64"),
        (
            "tiny",
            _variant("falcon", checkpoint_path="falcon"),
            "family falcon, the model has llama",
        ),
        (
            "tiny",
            _variant("more", checkpoint_path="more-heads"),
            "num_heads 8, more than the model's 4",
        ),
    ],
    ids=[
        "int4-width",
        "2:4-width",
        "pruned-int4",
        "fraction-without-pruning",
        "other-shape",
        "other-family",
        "more-heads",
    ],
)
def test_variants_the_model_cannot_take(odd_root, checkpoint, variant, reason):
    with pytest.raises(InvalidArgument) as err:
        _register(odd_root, checkpoint, variant)
    message = str(err.value)
    assert message.startswith(f"variant {variant.name!r} cannot apply to this model: "), message
    assert reason in message


def test_a_structured_fraction_other_than_the_served_one_is_refused(odd_root):
    """Accepted, a variant pruned at 0.5 was profiled and deployed at the default 0.25
    (a DeploymentConfig carries no fraction), its accuracy score standing for a model
    nobody ran."""
    half = _variant("half", pruning=common.PRUNING_STRUCTURED, structured_prune_fraction=0.5)
    with pytest.raises(InvalidArgument) as err:
        _register(odd_root, "tiny", half)
    assert "structured_prune_fraction 0.5 cannot be served" in str(err.value)
    assert "give 0.25 or leave it unset" in str(err.value)


def test_variants_the_model_can_take(odd_root):
    # The same compressions on widths that take them, and a pre-pruned checkpoint.
    model = _register(
        odd_root,
        "tiny",
        _variant("int4", weight_quant=common.WEIGHT_QUANT_INT4),
        _variant("sparse", pruning=common.PRUNING_SEMI_STRUCTURED_2_4),
        _variant(
            "pruned-int4",
            weight_quant=common.WEIGHT_QUANT_INT4,
            pruning=common.PRUNING_STRUCTURED,
            structured_prune_fraction=0.25,
        ),
        _variant("slim", pruning=common.PRUNING_NONE, checkpoint_path="slim-mlp"),
    )
    assert [v.name for v in model.variants] == ["int4", "sparse", "pruned-int4", "slim"]
    # int8 has a fallback for any width; 2:4 takes hidden 36 (a multiple of 4).
    _register(
        odd_root,
        "h36",
        _variant("int8", weight_quant=common.WEIGHT_QUANT_INT8),
        _variant("sparse", pruning=common.PRUNING_SEMI_STRUCTURED_2_4),
    )


def test_variant_problem_is_pure():
    # Built from the config alone, no weights: the check needs only the shape.
    import tempfile
    from pathlib import Path

    from fingerprint_svc.registry import variant_problem
    from services.engine_rules import projection_inputs
    from services.models.checkpoint import read_config
    from services.models.families import parse_config

    with tempfile.TemporaryDirectory() as tmp:
        create_checkpoint(Path(tmp) / "m", **{**SHAPE, "intermediate_size": 200})
        spec = parse_config(read_config(Path(tmp) / "m"))
    shape = {
        "hidden": spec.hidden_size,
        "heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "mlp_width": spec.intermediate_size,
    }
    assert projection_inputs(**shape) == {
        "hidden_size": 64,
        "attention output (heads x head_dim)": 64,
        "MLP width": 200,
    }
    assert projection_inputs(**shape, prune_fraction=0.25)["MLP width"] == 150
    # GQA (4 heads in 2 groups): each group keeps 2 - floor(0.5 * 2) = 1 query head.
    assert (
        projection_inputs(**shape, prune_fraction=0.5)["attention output (heads x head_dim)"] == 32
    )
    # At tp = 2 each rank's share: 2 heads of 16, 100 MLP channels (the row-parallel
    # projections' inputs); the hidden size stays whole.
    assert projection_inputs(**shape, tp=2) == {
        "hidden_size": 64,
        "attention output (heads x head_dim)": 32,
        "MLP width": 100,
    }
    int4 = _variant("int4", weight_quant=common.WEIGHT_QUANT_INT4)
    assert variant_problem(int4, spec) is None
    assert variant_problem(_variant(), spec, base=spec) is None


def test_only_a_failed_or_unprofiled_model_with_the_same_checkpoint_is_registered_again():
    from fingerprint_svc.registry import check_retry
    from services.errors import AlreadyExists

    new = model_pb.Model(model_id="m", checkpoint_path="a")
    failed = model_pb.Model(model_id="m", checkpoint_path="a", state=model_pb.MODEL_STATE_FAILED)
    check_retry(failed, new, profiling=False, skip_profiling=False)
    check_retry(failed, new, profiling=False, skip_profiling=True)
    # A model registered without profiling is profiled by registering it again (the
    # estimator's "not profiled yet" said so, and the id was taken)...
    skipped = model_pb.Model(
        model_id="m", checkpoint_path="a", state=model_pb.MODEL_STATE_REGISTERED
    )
    check_retry(skipped, new, profiling=False, skip_profiling=False)
    # A profile left incomplete (an agent or a worker gone) is completed by registering
    # again, as its reason says (that was refused: a probe); not without profiling.
    incomplete = model_pb.Model(
        model_id="m",
        checkpoint_path="a",
        state=model_pb.MODEL_STATE_PROFILED,
        state_reason="incomplete: 1 profiling job(s) failed because ...",
    )
    check_retry(incomplete, new, profiling=False, skip_profiling=False)
    with pytest.raises(AlreadyExists, match=r"already registered \(PROFILED\)"):
        check_retry(incomplete, new, profiling=False, skip_profiling=True)
    with pytest.raises(AlreadyExists):
        check_retry(incomplete, new, profiling=True, skip_profiling=False)
    # ... but not again without profiling: that would change nothing.
    with pytest.raises(AlreadyExists, match=r"already registered \(REGISTERED\)"):
        check_retry(skipped, new, profiling=False, skip_profiling=True)
    # How to register it again is said (a note told to "register the model again", and
    # the id was taken).
    with pytest.raises(
        AlreadyExists,
        match=r"already registered \(PROFILED\); to register it again, delete it first "
        r"\(`iserve model delete m`, once no deployment serves it\)$",
    ):
        check_retry(
            model_pb.Model(model_id="m", checkpoint_path="a", state=model_pb.MODEL_STATE_PROFILED),
            new,
            profiling=False,
            skip_profiling=False,
        )
    with pytest.raises(AlreadyExists, match="already registered"):
        check_retry(failed, new, profiling=True, skip_profiling=False)
    other = model_pb.Model(model_id="m", checkpoint_path="b")
    with pytest.raises(
        AlreadyExists, match="a FAILED model is registered again only with the same"
    ):
        check_retry(failed, other, profiling=False, skip_profiling=False)
    with pytest.raises(AlreadyExists, match="a REGISTERED model is registered again only"):
        check_retry(skipped, other, profiling=False, skip_profiling=False)


@pytest.mark.parametrize("value", ["", "a:b", "a/b", "x" * 129, "sp ace"])
def test_deployment_and_request_ids_share_one_rule(value):
    with pytest.raises(InvalidArgument, match="invalid deployment_id"):
        check_deployment_id(value)
    if value:
        with pytest.raises(InvalidArgument, match="invalid request_id"):
            check_request_id(value)
    check_deployment_id("llama-2-7b-0a1b2c3d")
    check_request_id("")  # a request id is optional
    check_request_id("Req_1.2-3")
