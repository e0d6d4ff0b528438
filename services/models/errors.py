"""Errors a user can cause by registering a model iserve cannot read or run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar


class UnsupportedArchitecture(ValueError):
    """The config describes a model family or feature iserve cannot serve."""


# The features noted (instead of refused) while a config is read for its shape alone.
_SHAPE_ONLY: ContextVar[list[str] | None] = ContextVar("iserve_shape_only", default=None)


@contextlib.contextmanager
def shape_only() -> Iterator[list[str]]:
    """Within it, configs are read for their shape alone (the estimator's imports of
    measurements taken elsewhere, never run by iserve): a feature the engine cannot run
    but that leaves the shape as read goes into the yielded list instead of being
    refused (:func:`engine_cannot_run`)."""
    notes: list[str] = []
    token = _SHAPE_ONLY.set(notes)
    try:
        yield notes
    finally:
        _SHAPE_ONLY.reset(token)


def engine_cannot_run(message: str) -> None:
    """Refuse a config feature iserve's engine does not run (a RoPE variant, an
    activation, a windowed attention, pre-quantized weights) but which leaves the
    model's shape as read: UnsupportedArchitecture, or a note under :func:`shape_only`
    (the caller then reads on as if the feature were absent)."""
    notes = _SHAPE_ONLY.get()
    if notes is None:
        raise UnsupportedArchitecture(message)
    if message not in notes:  # a field read twice is one feature
        notes.append(message)


class InvalidConfig(ValueError):
    """The config is missing a field or its fields contradict each other."""


class InvalidCheckpoint(ValueError):
    """The checkpoint directory is unreadable, incomplete or does not match its config."""
