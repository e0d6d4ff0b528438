"""The engine's layer clock: what the profiler reads to time one decoder layer in a run."""

from __future__ import annotations

from monitor_agent.engine.engine import Engine, SamplingConfig


def test_the_clock_counts_prefill_and_decode_layer_passes_and_their_time(checkpoint):
    assert Engine(checkpoint, max_seq_len=32, num_threads=1).layer_clock is None  # opt-in
    engine = Engine(checkpoint, max_seq_len=32, num_threads=1, time_layers=True)
    clock = engine.layer_clock
    assert clock is not None
    assert (clock.prefill_layer_passes, clock.decode_layer_passes) == (0, 0)
    tokens = list(engine.generate([5, 6, 7, 8], 5, SamplingConfig(ignore_eos=True)))
    assert len(tokens) == 5
    # One prefill over the prompt, then a decode step per further token; 2 layers each.
    assert clock.prefill_layer_passes == 2
    assert clock.decode_layer_passes == 2 * 4
    assert clock.prefill_seconds > 0 and clock.decode_seconds > 0
    # Seconds, not milliseconds: a layer of this tiny model takes well under 50 ms.
    assert clock.decode_seconds / clock.decode_layer_passes < 0.05
