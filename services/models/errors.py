"""Errors a user can cause by registering a model iserve cannot read or run."""


class UnsupportedArchitecture(ValueError):
    """The config describes a model family or feature iserve cannot serve."""


class InvalidConfig(ValueError):
    """The config is missing a field or its fields contradict each other."""


class InvalidCheckpoint(ValueError):
    """The checkpoint directory is unreadable, incomplete or does not match its config."""
