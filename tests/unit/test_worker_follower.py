"""A follower rank measures its memory around each step as rank 0's batch core measures
its own, and publishes the figure when it grows (monitor_agent.worker.follower)."""

from __future__ import annotations

import torch

from monitor_agent.engine.engine import Engine
from monitor_agent.worker.follower import FollowerPeak
from services.models.checkpoint import create_checkpoint

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def _step(engine: Engine, tokens: int):
    """One prefill of ``tokens`` tokens into slot 0, as a follower's compute."""
    ids = torch.arange(1, tokens + 1)[None]
    positions = torch.arange(tokens)[None]
    slots = torch.tensor([0])
    return (lambda: engine.model(ids, positions, slots, last_token_only=True)), positions


def test_a_follower_measures_its_steps_and_publishes_each_growth(tmp_path):
    checkpoint = create_checkpoint(tmp_path / "ckpt", **SMALL, seed=3)
    engine = Engine(checkpoint, max_seq_len=128, max_batch=2, num_threads=1)
    held = engine.memory.weight_bytes + engine.memory.kv_cache_bytes
    published: list[int] = []
    peak = FollowerPeak(engine.batch, lambda: engine.memory.resident_bytes, published.append)
    with torch.inference_mode():
        compute, positions = _step(engine, 16)
        out = peak.around_stage(compute, positions)
        assert out.shape == (1, 1, engine.spec.vocab_size)  # the step's own output
        first = engine.memory.peak_activation_bytes
        assert first > 0  # measured under the profiler, as rank 0's passes are
        assert published == [held + first]
        # The same shape again is not measured again, and nothing new is published.
        peak.around_stage(*_step(engine, 16))
        assert published == [held + first]
        # A prompt four times longer sets a higher peak, published in turn.
        peak.around_stage(*_step(engine, 64))
        assert engine.memory.peak_activation_bytes > first
        assert published == [held + first, engine.memory.resident_bytes]
