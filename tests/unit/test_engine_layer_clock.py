"""The engine's layer clock: what the profiler reads to time one decoder layer in a run."""

from __future__ import annotations

import time

import pytest

from monitor_agent.engine.engine import Engine, SamplingConfig
from monitor_agent.engine.layer_clock import clocked_layers
from services.models.checkpoint import create_checkpoint


def test_the_clock_counts_prefill_and_decode_layer_passes_and_their_time(checkpoint):
    assert Engine(checkpoint, max_seq_len=32, num_threads=1).layer_clock is None  # opt-in
    engine = Engine(checkpoint, max_seq_len=32, num_threads=1, time_layers=True)
    clock = engine.layer_clock
    assert clock is not None
    assert (clock.prefill_layer_passes, clock.decode_layer_passes) == (0, 0)
    tokens = list(engine.generate([5, 6, 7, 8], 5, SamplingConfig(ignore_eos=True)))
    assert len(tokens) == 5
    # One prefill over the prompt, then a decode step per further token: 2 layers each,
    # of which the clock times the second (clocked_layers).
    assert clocked_layers(2) == 1
    assert clock.prefill_layer_passes == 1
    assert clock.decode_layer_passes == 4
    assert clock.prefill_seconds > 0 and clock.decode_seconds > 0
    # Seconds, not milliseconds: a layer of this tiny model takes well under 50 ms.
    assert clock.decode_seconds / clock.decode_layer_passes < 0.05


def _slowed(layer, seconds: float):
    forward = layer.forward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    layer.forward = slow


@pytest.mark.parametrize("layers", [1, 3])
def test_the_first_layer_of_a_forward_is_timed_only_in_a_one_layer_stage(tmp_path, layers):
    """The first layer of a forward starts cold after the step's other work (10-40 %
    slower than the next on a CPU): the clock leaves it to the fit's "other" terms, where
    the full model pays it once per forward. A one-layer stage has only that one."""
    directory = create_checkpoint(
        tmp_path / "m", hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=2
    )
    engine = Engine(directory, max_seq_len=32, num_threads=1, time_layers=True)
    _slowed(engine.model.layers[0], 0.05)
    list(engine.generate([5, 6, 7, 8], 3, SamplingConfig(ignore_eos=True)))
    clock = engine.layer_clock
    assert clock.decode_layer_passes == 2 * clocked_layers(layers)
    assert clocked_layers(layers) == (1 if layers == 1 else layers - 1)
    per_layer = clock.decode_seconds / clock.decode_layer_passes
    if layers == 1:
        assert per_layer >= 0.05
    else:
        assert per_layer < 0.05
