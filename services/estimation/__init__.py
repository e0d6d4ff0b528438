"""Pure estimation maths: what every deployment configuration of a model costs.

numpy only; no gRPC, Redis or torch. One idea per module:

- ``space``: the configuration space (tp, pp, variant, batch) as a structured array.
- ``extrapolate``: fingerprints (a few hidden layers) to per-layer and other terms.
- ``references``: a model's fingerprint samples to its full-model reference figures.
- ``memory``: the papers' M2 memory model plus the hardware terms iserve adds.
- ``latency``: the papers' Eq. 2 (per phase), Eq. 3 and the batch model.
- ``calibrate``: fitting the hardware constants on measured full-model data.
- ``score``: every configuration estimated at once, and ranking per intent.

``docs/estimation.md`` has the maths and the evidence for each term.
"""
