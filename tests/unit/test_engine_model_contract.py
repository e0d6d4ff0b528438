"""The engine model's contract for transforms: pipeline stages, per-stage loading, the
attention attributes, Linear submodules and reduce hooks that tensor parallelism uses."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from monitor_agent.engine import loader
from monitor_agent.engine.loader import load_model
from monitor_agent.engine.model import Transformer
from services.models.checkpoint import create_checkpoint
from tests.parity.harness import randomize_weights

SMALL = {"hidden_size": 64, "num_layers": 4, "num_heads": 4}
FAMILIES = {
    "llama": {"arch": "llama", "num_kv_heads": 2},
    "qwen2-tied": {"arch": "qwen2", "num_kv_heads": 2, "tie_word_embeddings": True},
    "falcon-7b": {"arch": "falcon", "num_kv_heads": 1, "tie_word_embeddings": True},
    "falcon-40b": {"arch": "falcon", "num_kv_heads": 2},
    "gptj": {"arch": "gptj", "config_overrides": {"rotary_dim": 8}},
}
IDS = [0, 17, 230, 5, 99, 412, 8, 77, 300, 2, 150, 61]
ATOL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models run faster on one thread than on two busy cores (see tests/parity)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    create_checkpoint(directory, seed=41, **SMALL, **FAMILIES[request.param])
    randomize_weights(directory, seed=42)
    return directory


def ready(model: Transformer) -> Transformer:
    model.setup_caches(1, 64)
    return model


def step(model: Transformer, inputs: torch.Tensor, start: int) -> torch.Tensor:
    """One forward over positions [start, start + T) of slot 0."""
    positions = torch.arange(start, start + inputs.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        return model(inputs, positions, torch.tensor([0]))


def run_pipeline(stages: list[Transformer], ids: list[int], prefill: int) -> list[torch.Tensor]:
    """Prefill ids[:prefill], then decode the rest one token at a time, handing hidden
    states from stage to stage; the logits of every step."""
    outputs = []
    chunks = [(0, ids[:prefill])] + [(i, [ids[i]]) for i in range(prefill, len(ids))]
    for start, chunk in chunks:
        x = torch.tensor([chunk])
        for stage in stages:
            x = step(stage, x, start)
        outputs.append(x[0])
    return outputs


def test_two_stages_equal_the_whole_model(checkpoint: Path) -> None:
    whole = ready(load_model(checkpoint))
    first = ready(load_model(checkpoint, first_layer=0, layer_count=2))
    second = ready(load_model(checkpoint, first_layer=2))
    assert (first.has_embedding, first.has_head) == (True, False)
    assert (second.has_embedding, second.has_head) == (False, True)
    assert first.norm is None and first.lm_head is None and second.embed_tokens is None
    expected = run_pipeline([whole], IDS, prefill=8)
    actual = run_pipeline([first, second], IDS, prefill=8)
    for ours, theirs in zip(actual, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_uneven_three_stages(checkpoint: Path) -> None:
    whole = ready(load_model(checkpoint))
    stages = [
        ready(load_model(checkpoint, first_layer=first, layer_count=count))
        for first, count in ((0, 1), (1, 2), (3, 1))
    ]
    assert [len(stage.layers) for stage in stages] == [1, 2, 1]
    middle = stages[1]
    assert middle.embed_tokens is None and middle.norm is None and middle.lm_head is None
    expected = run_pipeline([whole], IDS, prefill=5)
    for ours, theirs in zip(run_pipeline(stages, IDS, prefill=5), expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_a_stage_reads_only_its_own_tensors(checkpoint: Path, monkeypatch) -> None:
    read: set[str] = set()
    real_safe_open = loader.safe_open

    class RecordingHandle:
        def __init__(self, handle) -> None:
            self._handle = handle

        def get_tensor(self, name: str) -> torch.Tensor:
            read.add(name)
            return self._handle.get_tensor(name)

        def get_slice(self, name: str):
            read.add(name)
            return self._handle.get_slice(name)

    class RecordingOpen:
        def __init__(self, *args, **kwargs) -> None:
            self._context = real_safe_open(*args, **kwargs)

        def __enter__(self) -> RecordingHandle:
            return RecordingHandle(self._context.__enter__())

        def __exit__(self, *exc) -> None:
            self._context.__exit__(*exc)

    monkeypatch.setattr(loader, "safe_open", RecordingOpen)
    model = load_model(checkpoint, first_layer=1, layer_count=2)
    spec = model.spec
    assert read == {source.tensor for source in spec.stage_weights(1, 2).values()}
    # "model.layers.N." and "transformer.h.N." both hold the layer index third.
    layers_read = {
        int(name.split(".")[2])
        for name in read
        if name.startswith(("model.layers.", "transformer.h."))
    }
    assert layers_read == {1, 2}
    assert not any("embed" in name or "wte" in name or name.startswith("lm_head") for name in read)


def test_tied_head_on_a_stage_without_the_embedding(checkpoint: Path) -> None:
    last = load_model(checkpoint, first_layer=3)
    whole = load_model(checkpoint)
    if not whole.spec.tie_word_embeddings:
        pytest.skip("untied checkpoint")
    assert whole.lm_head is None and last.lm_head is not None
    assert whole.embed_tokens is not None
    torch.testing.assert_close(last.lm_head.weight, whole.embed_tokens.weight, atol=0, rtol=0)


def test_modules_expose_the_transform_contract(checkpoint: Path) -> None:
    model = ready(load_model(checkpoint))
    spec = model.spec
    calls: list[str] = []

    def counting(label: str):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            calls.append(label)
            return x

        return reduce

    for j, layer in enumerate(model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        assert (attention.n_heads, attention.n_kv_heads, attention.head_dim) == (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert isinstance(getattr(attention, name), nn.Linear)
        for name in ("up_proj", "down_proj"):
            assert isinstance(getattr(mlp, name), nn.Linear)
        assert isinstance(mlp.gate_proj, nn.Linear) == spec.gated_mlp
        attention.reduce = counting(f"attn{j}")
        mlp.reduce = counting(f"mlp{j}")
    step(model, torch.tensor([IDS]), 0)
    assert sorted(calls) == sorted(f"{kind}{j}" for j in range(4) for kind in ("attn", "mlp"))


def test_fused_input_major_weights_compute_the_plain_model(checkpoint: Path) -> None:
    """float32 Linears load input-major and setup_caches fuses q/k/v into views of one
    weight; the logits match a copy that multiplies [out, in] weights one by one."""
    model = ready(load_model(checkpoint))
    plain = load_model(checkpoint)
    for linear in plain.modules():
        if type(linear) is nn.Linear:
            linear.weight = nn.Parameter(linear.weight.detach().contiguous())
    plain.setup_caches(1, 64)
    for layer, plain_layer in zip(model.layers, plain.layers, strict=True):
        attention = layer.self_attn
        assert attention.qkv_weight is not None
        fused_storage = attention.qkv_weight.untyped_storage().data_ptr()
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = getattr(attention, name).weight
            assert weight.untyped_storage().data_ptr() == fused_storage
            assert torch.equal(weight, getattr(plain_layer.self_attn, name).weight)
        assert layer.mlp.down_proj.weight.stride() == (1, layer.mlp.down_proj.out_features)
        plain_layer.self_attn.qkv_weight = plain_layer.self_attn.qkv_bias = None
    fused_logits = step(model, torch.tensor([IDS]), 0)
    plain_logits = step(plain, torch.tensor([IDS]), 0)
    torch.testing.assert_close(fused_logits, plain_logits, atol=1e-5, rtol=0)
    # A second setup_caches re-fuses what it fused before, in the same layout.
    model.setup_caches(1, 64)
    assert model.layers[0].self_attn.qkv_weight.stride(0) == 1


def test_sharded_checkpoint_loads_stage_by_stage(tmp_path: Path) -> None:
    """Fused Falcon-40B projections sliced by rows out of a multi-file checkpoint."""
    shape = {**SMALL, **FAMILIES["falcon-40b"], "seed": 5}
    single = create_checkpoint(tmp_path / "single", **shape)
    sharded = create_checkpoint(tmp_path / "sharded", **shape, max_shard_bytes=60_000)
    assert len(list(sharded.glob("*.safetensors"))) > 3
    expected = run_pipeline([ready(load_model(single))], IDS, prefill=6)
    stages = [ready(load_model(sharded, first_layer=0, layer_count=3))]
    stages.append(ready(load_model(sharded, first_layer=3)))
    for ours, theirs in zip(run_pipeline(stages, IDS, prefill=6), expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_bad_stage_arguments(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="first_layer"):
        load_model(checkpoint, first_layer=4)
    with pytest.raises(ValueError, match="layer_count"):
        load_model(checkpoint, first_layer=2, layer_count=3)


@pytest.mark.parametrize(
    ("value", "dtype", "says"),
    [
        (float("nan"), "float32", "holds NaN or infinite values"),
        (float("-inf"), "bfloat16", "holds NaN or infinite values"),
        (1e6, "float16", "beyond the torch.float16 it is served in"),
    ],
)
def test_weights_that_are_not_finite_where_served_are_refused_at_load(
    tmp_path: Path, monkeypatch, value: float, dtype: str, says: str
) -> None:
    """NaN weights loaded and served: greedy requests got garbage, sampled ones failed
    their whole batch with an INTERNAL error from torch.multinomial."""
    from safetensors.torch import load_file, save_file

    ckpt = create_checkpoint(tmp_path / "ckpt", **{**SMALL, **FAMILIES["llama"]})
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 5] = value
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(loader, "_CHECK_CHUNK", 7)  # the value lies in a later chunk
    with pytest.raises(loader.InvalidCheckpoint, match=f"{name}.*{says}"):
        load_model(ckpt, dtype=dtype)
    load_model(ckpt, first_layer=0, layer_count=1)  # a stage without that layer loads


# --- tensor parallelism is possible with the hooks and attributes alone --------------------


class ThreadAllReduce:
    """Sums one tensor per rank; each rank runs in its own thread."""

    def __init__(self, world: int) -> None:
        self._barrier = threading.Barrier(world, timeout=60)
        self._parts: list[torch.Tensor | None] = [None] * world

    def __call__(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self._parts[rank] = x
        self._barrier.wait()
        total = torch.stack(self._parts).sum(0)  # type: ignore[arg-type]
        self._barrier.wait()
        return total


def _rows(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    out = nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None)
    out.weight.data = linear.weight.data[start:stop].clone()
    if linear.bias is not None:
        out.bias.data = linear.bias.data[start:stop].clone()
    return out


def _columns(linear: nn.Linear, start: int, stop: int, keep_bias: bool) -> nn.Linear:
    out = nn.Linear(stop - start, linear.out_features, bias=linear.bias is not None)
    out.weight.data = linear.weight.data[:, start:stop].clone()
    if linear.bias is not None:
        out.bias.data = linear.bias.data.clone() if keep_bias else torch.zeros_like(linear.bias)
    return out


def shard(model: Transformer, rank: int, world: int, reduce: ThreadAllReduce) -> Transformer:
    """A minimal Megatron-style shard: this rank's heads and MLP channels."""
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        heads, kv_heads, d = (
            attention.n_heads // world,
            attention.n_kv_heads // world,
            attention.head_dim,
        )
        q = (rank * heads * d, (rank + 1) * heads * d)
        kv = (rank * kv_heads * d, (rank + 1) * kv_heads * d)
        attention.q_proj = _rows(attention.q_proj, *q)
        attention.k_proj = _rows(attention.k_proj, *kv)
        attention.v_proj = _rows(attention.v_proj, *kv)
        attention.o_proj = _columns(attention.o_proj, *q, keep_bias=rank == 0)
        attention.n_heads, attention.n_kv_heads = heads, kv_heads
        inner = mlp.up_proj.out_features // world
        channels = (rank * inner, (rank + 1) * inner)
        if mlp.gate_proj is not None:
            mlp.gate_proj = _rows(mlp.gate_proj, *channels)
        mlp.up_proj = _rows(mlp.up_proj, *channels)
        mlp.down_proj = _columns(mlp.down_proj, *channels, keep_bias=rank == 0)
        attention.reduce = partial(reduce, rank)
        mlp.reduce = partial(reduce, rank)
    return model


def test_two_way_tensor_parallel_shards_match(checkpoint: Path) -> None:
    whole = ready(load_model(checkpoint))
    if whole.spec.num_kv_heads % 2:
        pytest.skip("tensor parallelism needs the KV heads to divide evenly")
    expected = step(whole, torch.tensor([IDS]), 0)
    reduce = ThreadAllReduce(2)
    shards = [ready(shard(load_model(checkpoint), rank, 2, reduce)) for rank in range(2)]
    results: list[torch.Tensor | None] = [None, None]

    def run(rank: int) -> None:
        results[rank] = step(shards[rank], torch.tensor([IDS]), 0)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert shards[0].layers[0].self_attn.kv_cache.keys.shape[1] == whole.spec.num_kv_heads // 2
    for result in results:
        assert result is not None
        torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)


def test_a_prefill_from_an_empty_cache_attends_causally_without_a_mask(checkpoint: Path) -> None:
    """A prompt of T tokens built a boolean [T, T] mask that attention copied to floats:
    5 T² bytes (1.3 GiB at 16k tokens) that no reservation counted. A prefill from
    position 0 now attends with is_causal, and gives the logits the mask gave."""
    from monitor_agent.engine import layers

    model = ready(load_model(checkpoint))
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, attn_mask=None, is_causal=False, **kwargs):
        seen.append((attn_mask is None, is_causal))
        return sdpa(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    ids = torch.tensor([IDS])
    original = layers.F.scaled_dot_product_attention
    layers.F.scaled_dot_product_attention = recording
    try:
        causal = step(model, ids, 0)
        assert seen and all(unmasked and causal_ for unmasked, causal_ in seen)
        masked_at = model._attention_mask  # noqa: SLF001 - the mask the old path built

        def built(positions, kv_len):
            keys = torch.arange(kv_len)
            return (keys <= positions[:, :, None]).unsqueeze(1)

        model._attention_mask = built  # noqa: SLF001
        explicit = step(model, ids, 0)
        model._attention_mask = masked_at  # noqa: SLF001
        # A continuation (positions from 8 on) still needs its mask.
        seen.clear()
        step(model, ids[:, :4], 8)
        assert seen and all(not unmasked for unmasked, _ in seen)
    finally:
        layers.F.scaled_dot_product_attention = original
    torch.testing.assert_close(causal, explicit, atol=ATOL, rtol=0)
