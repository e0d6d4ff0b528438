"""Tensor-parallel sharding rules, in one process: ranks are threads that sum their
partial outputs through a barrier, so every family and degree is cheap to check. The
real multi-process path (torch.distributed) is in test_engine_parallel.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from monitor_agent.engine import loader
from monitor_agent.engine.loader import load_model
from monitor_agent.engine.tensor_parallel import (
    TensorShard,
    head_slice,
    narrow_rows,
    shard_sources,
)
from services.models.checkpoint import create_checkpoint, read_config
from services.models.families import parse_config
from tests.parity.harness import randomize_weights

SMALL = {"hidden_size": 64, "num_layers": 2}
FAMILIES = {
    # (shape, tensor-parallel degrees to check)
    "llama-gqa": ({"arch": "llama", "num_heads": 4, "num_kv_heads": 2}, (2, 4)),
    "qwen2-bias": ({"arch": "qwen2", "num_heads": 4, "num_kv_heads": 2}, (2,)),
    "falcon-7b-mqa": ({"arch": "falcon", "num_heads": 4, "num_kv_heads": 1}, (2, 4)),
    "falcon-40b": (
        {"arch": "falcon", "num_heads": 4, "num_kv_heads": 2, "config_overrides": {"bias": True}},
        (2, 4),
    ),
    "gptj": ({"arch": "gptj", "num_heads": 4, "config_overrides": {"rotary_dim": 8}}, (2,)),
}
IDS = [0, 17, 230, 5, 99, 412, 8, 77, 300, 2]
ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[Path, tuple[int, ...]]:
    shape, degrees = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    create_checkpoint(directory, seed=3, **SMALL, **shape)
    randomize_weights(directory, seed=4)
    return directory, degrees


class ThreadGroup:
    """An all-reduce over ``size`` threads, summing in rank order (deterministic)."""

    def __init__(self, size: int) -> None:
        self._barrier = threading.Barrier(size, timeout=60)
        self._parts: list[torch.Tensor | None] = [None] * size

    def reducer(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self._parts[rank] = x
            self._barrier.wait()
            total = torch.stack(self._parts).sum(0)  # type: ignore[arg-type]
            self._barrier.wait()
            return total

        return all_reduce


def _prefill_and_decode(model, ids: list[int], prefill: int) -> list[torch.Tensor]:
    model.setup_caches(1, 64)
    outputs = []
    with torch.inference_mode():
        chunks = [(0, ids[:prefill])] + [(i, [ids[i]]) for i in range(prefill, len(ids))]
        for start, chunk in chunks:
            positions = torch.arange(start, start + len(chunk)).unsqueeze(0)
            outputs.append(model(torch.tensor([chunk]), positions, torch.tensor([0]))[0])
    return outputs


def _run_sharded(checkpoint: Path, size: int) -> list[list[torch.Tensor]]:
    group = ThreadGroup(size)
    shards = [
        load_model(checkpoint, tensor_parallel=TensorShard(size, rank, group.reducer(rank)))
        for rank in range(size)
    ]
    results: list[list[torch.Tensor]] = [[] for _ in range(size)]

    def run(rank: int) -> None:
        results[rank] = _prefill_and_decode(shards[rank], IDS, prefill=6)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def test_every_rank_of_every_degree_matches_the_whole_model(family) -> None:
    checkpoint, degrees = family
    expected = _prefill_and_decode(load_model(checkpoint), IDS, prefill=6)
    for size in degrees:
        for rank, outputs in enumerate(_run_sharded(checkpoint, size)):
            assert len(outputs) == len(expected), (size, rank)
            for ours, theirs in zip(outputs, expected, strict=True):
                torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_a_shard_holds_its_heads_and_one_bias(family) -> None:
    checkpoint, degrees = family
    whole = load_model(checkpoint)
    spec = whole.spec
    size = degrees[-1]
    for rank in range(size):
        shard = load_model(checkpoint, tensor_parallel=TensorShard(size, rank))
        heads = head_slice(spec, size, rank)
        attention, mlp = shard.layers[0].self_attn, shard.layers[0].mlp
        d = spec.head_dim
        assert attention.n_heads == spec.num_heads // size
        assert attention.n_kv_heads == max(1, spec.num_kv_heads // size)
        assert attention.q_proj.weight.shape == (attention.n_heads * d, spec.hidden_size)
        assert attention.o_proj.weight.shape == (spec.hidden_size, attention.n_heads * d)
        assert mlp.down_proj.weight.shape == (spec.hidden_size, spec.intermediate_size // size)
        full_attention = whole.layers[0].self_attn
        torch.testing.assert_close(
            attention.k_proj.weight,
            full_attention.k_proj.weight[heads.kv_start * d : heads.kv_stop * d],
            atol=0,
            rtol=0,
        )
        torch.testing.assert_close(
            attention.o_proj.weight,
            full_attention.o_proj.weight[:, heads.q_start * d : heads.q_stop * d],
            atol=0,
            rtol=0,
        )
        # A row-parallel bias is added once: tensor rank 0 keeps it, the others have none.
        if spec.attn_out_bias:
            assert (attention.o_proj.bias is not None) == (rank == 0)
        if spec.mlp_bias:
            assert (mlp.down_proj.bias is not None) == (rank == 0)
            assert mlp.up_proj.bias is not None
        # Embedding and head are replicated.
        assert shard.embed_tokens.weight.shape == whole.embed_tokens.weight.shape


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "expected_kv"),
    [
        (8, 4, 2, [(0, 2), (2, 4)]),  # GQA, KV heads split
        (8, 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),  # MHA
        (8, 1, 4, [(0, 1)] * 4),  # multi-query: the one KV head everywhere
        (8, 2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # GQA with fewer KV heads than ranks
        (8, 2, 8, [(0, 1)] * 4 + [(1, 2)] * 4),
    ],
)
def test_kv_heads_follow_the_query_heads(tmp_path, heads, kv_heads, size, expected_kv) -> None:
    directory = create_checkpoint(
        tmp_path / "c", hidden_size=8 * heads, num_layers=1, num_heads=heads, num_kv_heads=kv_heads
    )
    spec = parse_config(read_config(directory))
    group = heads // kv_heads
    for rank in range(size):
        slice_ = head_slice(spec, size, rank)
        assert (slice_.kv_start, slice_.kv_stop) == expected_kv[rank]
        # Every query head of the rank attends with a KV head the rank holds.
        assert all(
            slice_.kv_start <= q // group < slice_.kv_stop
            for q in range(slice_.q_start, slice_.q_stop)
        )


@pytest.mark.parametrize(
    ("shape", "size", "message"),
    [
        ({"num_heads": 4, "num_kv_heads": 2}, 8, "attention heads"),
        ({"num_heads": 6, "num_kv_heads": 3}, 2, "KV heads"),
        ({"num_heads": 4, "num_kv_heads": 2, "intermediate_size": 90}, 4, "MLP width"),
        ({"num_heads": 4, "num_kv_heads": 2}, 3, "one of"),
    ],
)
def test_shapes_that_do_not_split_are_refused(tmp_path, shape, size, message) -> None:
    directory = create_checkpoint(tmp_path / "c", hidden_size=48, num_layers=1, **shape)
    with pytest.raises(ValueError, match=message):
        load_model(directory, tensor_parallel=TensorShard(size, 0))


def test_narrow_rows_maps_into_fused_ranges() -> None:
    # Falcon-40B-style fused rows: query rows of two KV groups, 32 rows each.
    fused_queries = ((0, 32), (64, 96))
    assert narrow_rows(fused_queries, 0, 32) == ((0, 32),)
    assert narrow_rows(fused_queries, 32, 64) == ((64, 96),)
    assert narrow_rows(fused_queries, 16, 48) == ((16, 32), (64, 80))
    assert narrow_rows(None, 8, 16) == ((8, 16),)
    assert narrow_rows(((0, 8), (8, 16)), 4, 12) == ((4, 12),)
    with pytest.raises(ValueError, match="outside"):
        narrow_rows(((0, 8),), 4, 12)


def test_a_rank_reads_only_its_slices(family, monkeypatch) -> None:
    checkpoint, degrees = family
    size = degrees[0]
    requested: dict[str, list] = {}
    real_safe_open = loader.safe_open

    class RecordingSlice:
        def __init__(self, name: str, inner) -> None:
            self._name, self._inner = name, inner

        def get_shape(self):
            return self._inner.get_shape()

        def __getitem__(self, index):
            requested.setdefault(self._name, []).append(index)
            return self._inner[index]

    class RecordingHandle:
        def __init__(self, handle) -> None:
            self._handle = handle

        def get_tensor(self, name: str) -> torch.Tensor:
            requested.setdefault(name, []).append("all")
            return self._handle.get_tensor(name)

        def get_slice(self, name: str):
            return RecordingSlice(name, self._handle.get_slice(name))

    class RecordingOpen:
        def __init__(self, *args, **kwargs) -> None:
            self._context = real_safe_open(*args, **kwargs)

        def __enter__(self) -> RecordingHandle:
            return RecordingHandle(self._context.__enter__())

        def __exit__(self, *exc) -> None:
            self._context.__exit__(*exc)

    monkeypatch.setattr(loader, "safe_open", RecordingOpen)
    model = load_model(checkpoint, tensor_parallel=TensorShard(size, 1))
    sharded = {
        name
        for name, source in shard_sources(
            model.spec, model.spec.stage_weights(), TensorShard(size, 1)
        ).items()
        if source.rows is not None or source.columns is not None
    }
    assert sharded, "nothing was sharded"
    sources = model.spec.stage_weights()
    for name in sharded:
        tensor = sources[name].tensor
        assert "all" not in requested[tensor], f"{tensor} was read whole"
