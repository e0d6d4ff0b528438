"""Registration decisions without a server."""

from __future__ import annotations

import pytest

from fingerprint_svc.registry import build_model, check_model_id, resolve_checkpoint
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.errors import InvalidArgument
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
