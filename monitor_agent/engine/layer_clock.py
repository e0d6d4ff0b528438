"""The layer clock: the time a stage's decoder layers take inside the runs of a profiling
worker, which the agent reads through ``GetWorkerStats`` (no torch here: the agent
imports it)."""

from __future__ import annotations

from dataclasses import dataclass


def clocked_layers(stage_layers: int) -> int:
    """How many of a forward's ``stage_layers`` layers the :class:`LayerClock` times: all
    but the first, or the one layer of a one-layer stage."""
    return stage_layers - 1 if stage_layers > 1 else stage_layers


@dataclass
class LayerClock:
    """Time this stage's decoder layers take, summed since the model was built.

    Kept only by engines built with ``time_layers`` (the agent's profiling workers). A
    prefill pass is a forward over more than one token per row, a decode pass one token
    per row; each pass over n layers adds :func:`clocked_layers` (n) layer passes. The
    profiler reads the counters before and after a run (``GetWorkerStats``): seconds /
    layer passes is the time of one decoder layer measured inside one run, so a
    fingerprint's per-layer cost needs no difference between two separately timed
    fingerprints. On CUDA the device is synchronised around the layers so that the clock
    sees their execution, not their launch.

    The first layer of a forward is left out when there are others: it starts cold after
    the step's work outside the layers (sampling, the token's gRPC message, the LM head
    streaming its weights through the cache) and takes 10-40 % longer than the next one
    on this project's CPU (int8, hidden 512: 0.44-0.47 against 0.40 ms). A full model
    pays that once per forward, its "other" terms in the fit; timed as a layer, a 1- or
    2-layer fingerprint read every layer of the full model 12-17 % slow (the layers after
    the first read within 1-3 % of the full model's). A one-layer stage times its layer
    (a model of one layer has no other); the fit prefers the clocks of longer stages.
    """

    prefill_seconds: float = 0.0
    prefill_layer_passes: int = 0
    decode_seconds: float = 0.0
    decode_layer_passes: int = 0

    def add(self, prefill: bool, seconds: float, layers: int) -> None:
        if prefill:
            self.prefill_seconds += seconds
            self.prefill_layer_passes += layers
        else:
            self.decode_seconds += seconds
            self.decode_layer_passes += layers
