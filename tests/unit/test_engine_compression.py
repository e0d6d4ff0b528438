"""Weight-only quantization and pruning: accuracy of the replaced Linears, the int4 and
2:4 storage formats, shapes after structured pruning, the bytes the engine holds, and
generation under each compression, in process and through the worker."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from monitor_agent.engine import quantize
from monitor_agent.engine.compression import CompressionSpec, apply_compression
from monitor_agent.engine.engine import Engine, SamplingConfig
from monitor_agent.engine.layers import Attention, DecoderLayer
from monitor_agent.engine.loader import load_model
from monitor_agent.engine.prune import (
    Sparse24Linear,
    prune_2_4_,
    prune_heads_,
    semi_structured_mask,
)
from monitor_agent.engine.quantize import (
    INT4_GROUP_SIZES,
    Int4Linear,
    Int8Linear,
    int4_group_size,
    pack_int4_plain,
    quantize_int4_rows,
    unpack_int4_plain,
)
from monitor_agent.engine.tensor_parallel import TensorShard
from services.models.checkpoint import create_checkpoint
from tests.parity.harness import randomize_weights

FAMILIES = {
    # hidden 128 with 4 heads: head_dim 32, inner widths multiples of 32 (kernel shapes)
    "llama-gqa": {"arch": "llama", "num_heads": 4, "num_kv_heads": 2},
    "falcon-7b": {"arch": "falcon", "num_heads": 4, "num_kv_heads": 1},
    "gptj": {"arch": "gptj", "num_heads": 4, "config_overrides": {"rotary_dim": 8}},
}
HIDDEN, LAYERS = 128, 2
MAX_SEQ_LEN = 64
PROMPT = "The river runs past the old mill and on towards the sea"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One thread: faster for tiny models, and the same kernels' order as the worker."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).norm() / expected.norm())


def _linear(in_features: int, out_features: int, *, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(linear.weight, std=0.05)
    if bias:
        nn.init.normal_(linear.bias, std=0.05)
    return linear


# ---- quantized Linears ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("in_features", "out_features"),
    [(256, 128), (96, 100), (72, 48)],  # 72: not a multiple of 16, the dequantizing path
)
def test_int8_linear_is_close_to_the_float_linear(in_features, out_features):
    linear = _linear(in_features, out_features)
    quantized = Int8Linear.from_linear(linear)
    assert quantized.weight_int8.dtype == torch.int8
    assert quantized.scales.shape == (out_features,)
    x = torch.randn(2, 5, in_features)
    expected = linear(x)
    assert quantized(x).shape == expected.shape and quantized(x).dtype == torch.float32
    assert _relative_error(quantized(x), expected) < 0.015
    assert _relative_error(quantized.dequantize(), linear.weight) < 0.01
    out_bf16 = quantized(x.bfloat16())
    assert out_bf16.dtype == torch.bfloat16
    assert _relative_error(out_bf16, expected) < 0.02


@pytest.mark.parametrize("layout", ["cpu-kernel", "plain"])
@pytest.mark.parametrize(
    ("in_features", "out_features", "group"),
    [(256, 128, 128), (256, 100, 32), (96, 64, 128), (48, 192, 64), (256, 600, 64)],
)  # 96 -> 32, 48 -> 16 (no kernel), 600 rows: three chunks, the last a partial row block
def test_int4_linear_is_close_to_the_float_linear(in_features, out_features, group, layout):
    linear = _linear(in_features, out_features)
    effective = int4_group_size(in_features, group)
    if layout == "cpu-kernel" and effective not in INT4_GROUP_SIZES:
        with pytest.raises(ValueError, match="use the plain layout"):
            Int4Linear.from_linear(linear, group, layout=layout)
        return
    quantized = Int4Linear.from_linear(linear, group, layout=layout)
    assert quantized.group_size == effective and quantized.layout == layout
    assert quantized.packed.dtype == torch.uint8
    rows = -(-out_features // 16) * 16 if layout == "cpu-kernel" else out_features
    assert quantized.packed.shape == (rows, in_features // 2)
    x = torch.randn(3, in_features)
    expected = linear(x)
    assert _relative_error(quantized(x), expected) < 0.12
    assert _relative_error(quantized.dequantize(), linear.weight) < 0.12
    # The layout's own matmul and dequantize-then-matmul compute the same product.
    reference = F.linear(x, quantized.dequantize(), linear.bias)
    assert _relative_error(quantized(x), reference) < 0.01


def test_int4_default_layout_is_the_kernels_where_it_runs():
    linear = _linear(256, 64)
    assert Int4Linear.from_linear(linear, 64).layout == "cpu-kernel"
    assert Int4Linear.from_linear(_linear(48, 64), 64).layout == "plain"  # groups of 16


def test_the_dequantizing_paths_match_the_kernels(monkeypatch):
    linear = _linear(128, 64)
    int8 = Int8Linear.from_linear(linear)
    kernel = Int4Linear.from_linear(linear, 64, layout="cpu-kernel")
    plain = Int4Linear.from_linear(linear, 64, layout="plain")
    x = torch.randn(4, 128)
    assert torch.equal(kernel.scales_and_zeros, plain.scales_and_zeros)
    assert _relative_error(plain(x), kernel(x)) < 0.01
    assert torch.allclose(plain.dequantize(), kernel.dequantize(), rtol=0, atol=1e-6)
    with_kernel = int8(x)
    monkeypatch.setattr(quantize, "_HAS_INT8_KERNEL", False)
    assert _relative_error(int8(x), with_kernel) < 0.01


def test_int4_kernel_layout_is_torchs_own_packing():
    linear = _linear(256, 96)
    quantized = Int4Linear.from_linear(linear, 64, layout="cpu-kernel")
    q, _, _ = quantize_int4_rows(linear.weight.detach().float(), 64)
    convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    assert torch.equal(quantized.packed, convert(q.int(), 1))


def test_int4_plain_packing_round_trips_exactly_two_values_per_byte():
    torch.manual_seed(1)
    values = torch.randint(0, 16, (100, 96), dtype=torch.uint8)
    packed = pack_int4_plain(values)
    assert packed.dtype == torch.uint8 and packed.shape == (100, 48)
    assert torch.equal(packed[0, 0], values[0, 0] | (values[0, 1] << 4))
    assert torch.equal(unpack_int4_plain(packed), values)
    with pytest.raises(ValueError, match="even number of columns"):
        pack_int4_plain(values[:, :95])


def test_int4_weights_packed_for_the_cpu_kernel_refuse_another_device():
    quantized = Int4Linear.from_linear(_linear(128, 64), 64, layout="cpu-kernel")
    with pytest.raises(RuntimeError, match="packed for the CPU kernel cannot run on meta"):
        quantized(torch.empty(1, 128, device="meta"))


def test_int4_keeps_pruned_zeros_near_zero():
    linear = _linear(128, 64, bias=False)
    prune_2_4_(linear)
    weight = Int4Linear.from_linear(linear, 32).dequantize()
    zeros = linear.weight == 0
    assert weight[zeros].abs().max() < 0.01 * linear.weight.abs().max()


def test_int4_group_sizes():
    assert int4_group_size(4096, 128) == 128
    assert int4_group_size(96, 128) == 32
    assert int4_group_size(48, 128) == 16
    with pytest.raises(ValueError, match="divisible by 8"):
        int4_group_size(12, 128)
    with pytest.raises(ValueError, match="power of two"):
        int4_group_size(128, 96)


# ---- pruning ----------------------------------------------------------------------------


def test_2_4_pruning_keeps_the_two_largest_of_every_four():
    linear = _linear(64, 32)
    original = linear.weight.detach().clone()
    prune_2_4_(linear)
    groups = linear.weight.view(32, 16, 4)
    assert ((groups == 0).sum(-1) == 2).all()  # exactly 2 zeros per group of 4
    kept = original.view(32, 16, 4).abs().topk(2, dim=-1).values.sum(-1)
    assert torch.allclose(groups.abs().sum(-1), kept)
    assert torch.equal(semi_structured_mask(linear.weight), linear.weight != 0)
    with pytest.raises(ValueError, match="divisible by 4"):
        semi_structured_mask(torch.ones(2, 6))


def test_compact_2_4_storage_equals_the_dense_pruned_linear():
    linear = _linear(256, 64)
    compact = Sparse24Linear.from_linear(linear)
    prune_2_4_(linear)
    assert torch.equal(compact.to_dense(), linear.weight)
    x = torch.randn(3, 256)
    torch.testing.assert_close(compact(x), linear(x))
    dense_bytes = linear.weight.numel() * 4
    compact_bytes = compact.values.nbytes + compact.positions.nbytes
    assert compact_bytes == dense_bytes // 2 + dense_bytes // 32  # values + 4 bits / group


def test_structured_pruning_drops_the_weakest_heads():
    from services.models.families import parse_config

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
    }
    attention = Attention(parse_config(config), torch.float32)
    for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
        nn.init.normal_(linear.weight)
    with torch.no_grad():
        attention.q_proj.weight[16:32] *= 0.01  # head 1 is the weakest
    prune_heads_(attention, 0.25)
    assert (attention.n_heads, attention.n_kv_heads) == (3, 3)
    assert attention.q_proj.weight.shape == attention.k_proj.weight.shape == (48, 64)
    assert attention.o_proj.weight.shape == (64, 48)


# ---- the engine under compression -------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    create_checkpoint(
        directory, hidden_size=HIDDEN, num_layers=LAYERS, seed=3, **FAMILIES[request.param]
    )
    randomize_weights(directory, seed=4)
    return directory


def load(checkpoint: Path, **compression) -> Engine:
    return Engine(checkpoint, max_seq_len=MAX_SEQ_LEN, max_batch=2, **compression)


def teacher_forced_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        positions = torch.arange(len(ids))[None]
        return engine.model(torch.tensor([ids]), positions, torch.tensor([0]))[0]


@pytest.fixture(scope="module")
def baseline(checkpoint: Path) -> Engine:
    return load(checkpoint)


COMPRESSIONS = {
    "int8": ({"weight_quant": "int8"}, 0.99),
    "int4": ({"weight_quant": "int4"}, 0.9),
    "2:4": ({"pruning": "2:4"}, None),
    "2:4-compact": ({"pruning": "2:4-compact"}, None),
    "2:4+int8": ({"pruning": "2:4", "weight_quant": "int8"}, None),
    "structured": ({"pruning": "structured", "prune_fraction": 0.5}, None),
    "structured+int4": ({"pruning": "structured", "weight_quant": "int4"}, None),
}


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_greedy_generation_under_each_compression(checkpoint, baseline, name):
    compression, min_cosine = COMPRESSIONS[name]
    engine = load(checkpoint, **compression)
    prompt = engine.encode(PROMPT)
    config = SamplingConfig(ignore_eos=True)
    tokens = [s.token_id for s in engine.generate(prompt, 8, config)]
    assert len(tokens) == 8 and all(0 <= t < engine.spec.vocab_size for t in tokens)
    # Two sequences decode together (batched rows through the compressed Linears).
    first, second = engine.generate(prompt, 4, config), engine.generate(prompt[:5], 4, config)
    both = [(next(first).token_id, next(second).token_id) for _ in range(4)]
    assert [a for a, _ in both] == tokens[:4]
    if min_cosine is not None:
        # Teacher-forced on the float model's greedy tokens, the logits stay close.
        greedy = [s.token_id for s in baseline.generate(prompt, 8, config)]
        ids = prompt + greedy
        cosine = F.cosine_similarity(
            teacher_forced_logits(engine, ids), teacher_forced_logits(baseline, ids), dim=-1
        )
        assert cosine.min() > min_cosine, cosine


def test_structured_pruning_shrinks_the_shapes_and_the_kv_cache(checkpoint, baseline):
    engine = load(checkpoint, pruning="structured", prune_fraction=0.5)
    spec = engine.spec
    group = spec.num_heads // spec.num_kv_heads
    heads = spec.num_heads // 2 if group == 1 else spec.num_kv_heads * (group - group // 2)
    kv_heads = heads if group == 1 else spec.num_kv_heads
    inner = spec.intermediate_size - (spec.intermediate_size // 2 // 16 * 16)
    for layer in engine.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        assert (attention.n_heads, attention.n_kv_heads) == (heads, kv_heads)
        assert attention.q_proj.weight.shape == (heads * spec.head_dim, spec.hidden_size)
        assert attention.k_proj.weight.shape == (kv_heads * spec.head_dim, spec.hidden_size)
        assert attention.o_proj.weight.shape == (spec.hidden_size, heads * spec.head_dim)
        assert mlp.up_proj.weight.shape == (inner, spec.hidden_size)
        assert mlp.down_proj.weight.shape == (spec.hidden_size, inner)
        assert attention.kv_cache.keys.shape == (2, kv_heads, MAX_SEQ_LEN, spec.head_dim)
    assert engine.memory.weight_bytes < baseline.memory.weight_bytes
    assert engine.memory.kv_cache_bytes * spec.num_kv_heads == (
        baseline.memory.kv_cache_bytes * kv_heads
    )


def test_structured_pruning_of_nothing_changes_nothing(checkpoint, baseline):
    engine = load(checkpoint, pruning="structured", prune_fraction=0.0)
    ids = engine.encode(PROMPT)
    assert torch.equal(teacher_forced_logits(engine, ids), teacher_forced_logits(baseline, ids))


def _projection_bytes(model: nn.Module, kind: str) -> tuple[int, int]:
    """(float32 bytes, expected quantized bytes) of every attention/MLP projection."""
    float_bytes = quantized_bytes = 0
    for layer in model.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        for block in (layer.self_attn, layer.mlp):
            for linear in block.children():
                if not isinstance(linear, nn.Linear):
                    continue
                rows, columns = linear.weight.shape
                float_bytes += linear.weight.nbytes
                if kind == "int8":
                    quantized_bytes += rows * columns + 2 * rows
                else:
                    group = int4_group_size(columns, 128)
                    # The CPU kernel's layout pads the rows to a multiple of 16.
                    padded = -(-rows // 16) * 16 if group in INT4_GROUP_SIZES else rows
                    quantized_bytes += padded * columns // 2 + (columns // group) * padded * 4
    return float_bytes, quantized_bytes


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_resident_bytes_fall_by_the_quantized_projections(checkpoint, baseline, kind):
    engine = load(checkpoint, weight_quant=kind)
    float_bytes, quantized_bytes = _projection_bytes(baseline.model, kind)
    assert engine.memory.weight_bytes == baseline.memory.weight_bytes - float_bytes + (
        quantized_bytes
    )
    assert engine.memory.kv_cache_bytes == baseline.memory.kv_cache_bytes
    ratio = quantized_bytes / float_bytes
    assert (0.25 < ratio < 0.27) if kind == "int8" else (0.125 < ratio < 0.2)
    assert engine.resident_bytes() < baseline.resident_bytes()
    # The embedding and the LM head keep the model dtype.
    assert engine.model.lm_head is None or type(engine.model.lm_head) is nn.Linear


def test_compact_2_4_holds_about_half_the_projection_bytes(checkpoint, baseline):
    engine = load(checkpoint, pruning="2:4-compact")
    float_bytes, _ = _projection_bytes(baseline.model, "int8")
    saved = baseline.memory.weight_bytes - engine.memory.weight_bytes
    assert saved == float_bytes // 2 - float_bytes // 32
    dense = load(checkpoint, pruning="2:4")
    assert dense.memory.weight_bytes == baseline.memory.weight_bytes


def test_apply_compression_transforms_a_single_layer(baseline):
    layer = DecoderLayer(baseline.spec, torch.float32)
    apply_compression(layer, CompressionSpec(weight_quant="int4", pruning="2:4"))
    for linear in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(linear, Int4Linear)
    assert isinstance(layer.attn_norm.weight, nn.Parameter)


@pytest.mark.parametrize(
    ("compression", "message"),
    [
        ({"weight_quant": "int3"}, "weight_quant must be one of"),
        ({"pruning": "1:4"}, "pruning must be one of"),
        ({"pruning": "structured", "prune_fraction": 1.0}, r"prune_fraction must be in \[0, 1\)"),
        ({"pruning": "2:4-compact", "weight_quant": "int8"}, "combine 2:4"),
    ],
)
def test_bad_compression_arguments_are_rejected(compression, message):
    with pytest.raises(ValueError, match=message):
        CompressionSpec(**compression)


# ---- on tensor-parallel shards ----------------------------------------------------------


def _run_shards(checkpoint: Path, spec: CompressionSpec, size: int) -> list[torch.Tensor]:
    """Logits of every rank of a ``size``-way tensor-parallel model compressed while it
    loads; ranks are threads that sum their partial outputs at a barrier."""
    barrier = threading.Barrier(size, timeout=60)
    parts: list[torch.Tensor | None] = [None] * size

    def reducer(rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            parts[rank] = x
            barrier.wait()
            total = torch.stack(parts).sum(0)  # type: ignore[arg-type]
            barrier.wait()
            return total

        return all_reduce

    compress = functools.partial(apply_compression, spec=spec)
    shards = [
        load_model(
            checkpoint,
            tensor_parallel=TensorShard(size, rank, reducer(rank)),
            on_layer_loaded=compress,
        )
        for rank in range(size)
    ]
    logits: list[torch.Tensor] = [torch.empty(0)] * size

    def run(rank: int) -> None:
        shards[rank].setup_caches(1, MAX_SEQ_LEN)
        with torch.inference_mode():
            logits[rank] = shards[rank](
                torch.tensor([TP_IDS]), torch.arange(10)[None], torch.tensor([0])
            )[0]

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for rank, shard in enumerate(shards):
        assert isinstance(shard.layers[0].mlp.down_proj, nn.Linear) == (
            spec.weight_quant == "none"
        ), rank
    return logits


TP_IDS = [0, 17, 230, 5, 99, 412, 8, 77, 300, 2]


@pytest.mark.parametrize(("kind", "min_cosine"), [("int8", 0.999), ("int4", 0.9)])
def test_each_tensor_parallel_rank_quantizes_its_own_shard(tmp_path, kind, min_cosine):
    checkpoint = create_checkpoint(
        tmp_path / "ckpt", hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4, num_kv_heads=2
    )
    randomize_weights(checkpoint, seed=4)
    spec = CompressionSpec(weight_quant=kind)
    whole = load_model(checkpoint, on_layer_loaded=functools.partial(apply_compression, spec=spec))
    reference = load_model(checkpoint)
    logits = []
    for model in (whole, reference):
        model.setup_caches(1, MAX_SEQ_LEN)
        with torch.inference_mode():
            logits.append(
                model(torch.tensor([TP_IDS]), torch.arange(10)[None], torch.tensor([0]))[0]
            )
    quantized, exact = logits
    assert F.cosine_similarity(quantized, exact, dim=-1).min() > min_cosine
    # A row-parallel shard scales (int8) or groups (int4) its own part of each row, so
    # the ranks' model is another, equally faithful quantization of the float model.
    for ranks in _run_shards(checkpoint, spec, 2):
        assert F.cosine_similarity(ranks, exact, dim=-1).min() > min_cosine


def test_structured_pruning_prunes_each_shard_consistently(tmp_path):
    checkpoint = create_checkpoint(
        tmp_path / "ckpt", hidden_size=HIDDEN, num_layers=LAYERS, num_heads=8, num_kv_heads=8
    )
    randomize_weights(checkpoint, seed=4)
    spec = CompressionSpec(pruning="structured", prune_fraction=0.25)
    first, second = _run_shards(checkpoint, spec, 2)
    assert torch.equal(first, second) and torch.isfinite(first).all()
    shard = load_model(
        checkpoint,
        tensor_parallel=TensorShard(2, 1),
        on_layer_loaded=functools.partial(apply_compression, spec=spec),
    )
    attention = shard.layers[0].self_attn
    assert (attention.n_heads, attention.n_kv_heads) == (3, 3)  # 4 local heads, 1 dropped


# ---- through the worker process ---------------------------------------------------------


def test_a_worker_serves_an_int8_model(tmp_path):
    import grpc

    from services.api import common_pb2 as common
    from services.api import worker_service_pb2 as worker_pb
    from services.api import worker_service_pb2_grpc
    from tests.unit.test_worker_process import start_worker

    checkpoint = create_checkpoint(
        tmp_path / "ckpt", hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4, num_kv_heads=2
    )
    proc, record = start_worker(
        checkpoint, tmp_path / "ready.json", tmp_path / "worker.log", "--weight-quant", "int8"
    )
    try:
        engine = Engine(checkpoint, max_seq_len=512, weight_quant="int8")
        assert record["resident_bytes"] == engine.memory.resident_bytes
        assert record["resident_bytes"] < Engine(checkpoint, max_seq_len=512).memory.resident_bytes
        expected = [
            s.token_id
            for s in engine.generate(engine.encode(PROMPT), 8, SamplingConfig(ignore_eos=True))
        ]
        with grpc.insecure_channel(f"127.0.0.1:{record['port']}") as channel:
            stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
            request = worker_pb.WorkerServiceGenerateRequest(
                request_id="q", prompt=PROMPT, max_tokens=8,
                sampling=common.SamplingParams(ignore_eos=True),
            )  # fmt: skip
            responses = list(stub.Generate(request, timeout=60))
        assert [r.token_ids[0] for r in responses] == expected
    finally:
        proc.terminate()
        assert proc.wait(15) == 0, (tmp_path / "worker.log").read_text()
    assert json.loads((tmp_path / "ready.json").read_text())["pid"] == proc.pid
