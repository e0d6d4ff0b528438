"""int8 KV cache: the memory it saves, its round-trip error and what it does to logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from monitor_agent.engine.engine import Engine, SamplingConfig
from monitor_agent.engine.kv_cache import (
    CacheAddress,
    LayerKVCache,
    kv_cache_bytes,
    kv_cache_quantization,
)

# head_dim 64, as in most real models: the scales cost 2 bytes per 64 int8 values.
SHAPE = {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
PROMPT = "The river runs past the old mill and on towards the sea"
MAX_SEQ_LEN, MAX_BATCH = 64, 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from services.models.checkpoint import create_checkpoint

    return create_checkpoint(tmp_path_factory.mktemp("kv_int8") / "ckpt", **SHAPE, seed=3)


def load(checkpoint: Path, dtype: str = "float32", kv: str | None = None) -> Engine:
    return Engine(
        checkpoint,
        dtype=dtype,
        max_seq_len=MAX_SEQ_LEN,
        max_batch=MAX_BATCH,
        num_threads=1,
        kv_cache_dtype=kv,
    )


@pytest.fixture(scope="module")
def fp32(checkpoint: Path) -> Engine:
    return load(checkpoint)


@pytest.fixture(scope="module")
def int8(checkpoint: Path) -> Engine:
    return load(checkpoint, kv="int8")


def test_int8_cache_holds_a_quarter_of_float32_and_half_of_bfloat16(checkpoint, fp32, int8):
    bf16, bf16_int8 = load(checkpoint, "bfloat16"), load(checkpoint, "bfloat16", "int8")
    elements = 2 * SHAPE["num_layers"] * 2 * 64 * MAX_SEQ_LEN * MAX_BATCH  # K+V, kv_heads 2
    assert kv_cache_bytes(fp32.model) == 4 * elements
    assert kv_cache_bytes(bf16.model) == 2 * elements
    # int8 values plus one bfloat16 scale per 64 values
    assert kv_cache_bytes(int8.model) == kv_cache_bytes(bf16_int8.model) == elements * 66 // 64
    assert kv_cache_bytes(fp32.model) / kv_cache_bytes(int8.model) > 3.8
    assert kv_cache_bytes(bf16.model) / kv_cache_bytes(bf16_int8.model) > 1.9
    # ... and the engine's resident tensors fall by the same bytes.
    saved = kv_cache_bytes(fp32.model) - kv_cache_bytes(int8.model)
    assert fp32.resident_bytes() - int8.resident_bytes() == saved
    assert int8.memory.kv_cache_bytes == kv_cache_bytes(int8.model)
    for module in int8.model.modules():
        if isinstance(module, LayerKVCache):
            assert module.keys.dtype == module.values.dtype == torch.int8


def test_round_trip_error_is_at_most_half_a_step() -> None:
    with kv_cache_quantization("int8"):
        cache = LayerKVCache(3, 2, 16, 64, torch.float32, "cpu")
    torch.manual_seed(0)
    k = torch.randn(2, 2, 5, 64) * torch.logspace(-3, 1, 5)[None, None, :, None]
    v = torch.randn(2, 2, 5, 64)
    # rows in slots 2 and 0, at different positions: the multi-slot write and read path
    address = CacheAddress(torch.tensor([2, 0]), torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]]))
    keys, values = cache.update(address, k, v)
    assert keys.dtype == torch.float32 and keys.shape == (2, 2, 8, 64)
    stored_k = torch.stack([keys[0, :, :5], keys[1, :, 3:8]])
    stored_v = torch.stack([values[0, :, :5], values[1, :, 3:8]])
    for original, stored in ((k, stored_k), (v, stored_v)):
        step = original.abs().amax(dim=-1, keepdim=True) / 127
        assert ((stored - original).abs() <= 0.51 * step + 1e-12).all()
    # the single-slot path reads back what the multi-slot path wrote
    one = CacheAddress(torch.tensor([0]), torch.tensor([[8]]))
    keys_0, _ = cache.update(one, k[1:, :, :1], v[1:, :, :1])
    torch.testing.assert_close(keys_0[0, :, 3:8], stored_k[1])


def test_int8_logits_stay_close_to_float32(fp32: Engine, int8: Engine) -> None:
    """Teacher-forced on fp32's greedy tokens, every step's logits keep cosine > 0.99."""
    prompt = fp32.encode(PROMPT)
    greedy = [s.token_id for s in fp32.generate(prompt, 12, SamplingConfig(ignore_eos=True))]
    ids = prompt + greedy
    with torch.inference_mode():
        positions = torch.arange(len(ids))[None]
        logits = [
            engine.model(torch.tensor([ids]), positions, torch.tensor([0]))[0]
            for engine in (fp32, int8)
        ]
    cosine = F.cosine_similarity(logits[0], logits[1], dim=-1)
    assert cosine.min() > 0.99, cosine
    agree = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean()
    print(f"int8 KV: min logits cosine {cosine.min():.5f}, argmax agreement {agree:.0%}")


def test_int8_engine_generates_in_a_batch(int8: Engine) -> None:
    prompt = int8.encode(PROMPT)
    config = SamplingConfig(ignore_eos=True)
    first, second = int8.generate(prompt, 6, config), int8.generate(prompt[:5], 6, config)
    steps = [(next(first), next(second)) for _ in range(6)]
    assert steps[-1][0].finished and steps[-1][1].finished


def test_unknown_kv_cache_dtypes_are_rejected(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be None .* got 'int4'"):
        load(checkpoint, kv="int4")
    with (
        pytest.raises(ValueError, match="KV-cache quantization must be one of"),
        kv_cache_quantization("fp8"),
    ):
        pass
