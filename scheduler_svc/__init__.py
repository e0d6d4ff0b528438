"""The scheduler: InferenceService, per-deployment queues and token streaming.

Run it with ``python -m scheduler_svc``.
"""
