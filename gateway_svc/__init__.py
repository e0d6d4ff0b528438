"""OpenAI-compatible HTTP gateway: ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models`` in front of the InferenceService (see ``gateway_svc.app``)."""
