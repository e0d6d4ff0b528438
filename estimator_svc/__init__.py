"""EstimatorService: the configuration map of profiled models (issue 4).

- ``profiles``: stored profile measurements as samples; the model's shape and variants.
- ``model_references``: samples to full-model references per prompt length; estimates.
- ``hardware_calibration``: fitting a hardware type's constants on its full-model runs.
- ``calibration_message``: a calibration's stored form; the shipped defaults.
- ``config_map``: a model's references on a hardware type, cached in Redis by hash.
- ``ranking``: an Intent message to a ranking of configurations.
- ``messages``: request checks and response messages.
- ``service``: the work against Redis; ``servicer``: the gRPC edge.
"""
