"""Identifiers: one rule per kind of id, for every service.

Ids clients choose (model ids, hardware types) follow :data:`ID_PATTERN`. Ids iserve
makes and clients pass back (deployment ids: ``<model id>-<hex>``) and request ids follow
:data:`TOKEN_PATTERN`. Both are safe as Redis key parts (no ':'), file names and URLs;
``services.state.keys`` still refuses a ':' as a last guard."""

from __future__ import annotations

import re
import secrets

from services.errors import InvalidArgument, shown

# Lowercase letters, digits, '.', '_' and '-', 1-64 characters, starting with a letter or
# digit: safe in Redis keys, file names and URLs. Always matched whole (fullmatch): "$"
# alone would let a trailing newline through.
ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
ID_RULE = "use 1-64 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"
# The same characters in either case, 1-128 of them, but not dots alone ("." and ".."
# name directories in a path).
TOKEN_PATTERN = re.compile(r"(?!\.+\Z)[A-Za-z0-9._-]{1,128}")
_TOKEN_RULE = "1-128 letters, digits, '.', '_' or '-', not dots alone"


# A node id (``ISERVE_NODE_ID``) is a part of Redis keys and of worker group names: a
# DNS name's characters (a Kubernetes node name fits), at most 253 of them.
NODE_ID_PATTERN = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,252})")
NODE_ID_RULE = "letters, digits, '.', '_' or '-' (at most 253, starting with a letter or digit)"


def check_node_id(node_id: str) -> None:
    if not NODE_ID_PATTERN.fullmatch(node_id):
        raise InvalidArgument(f"invalid node_id {shown(node_id)}: {NODE_ID_RULE}")


def check_device_id(device_id: str) -> None:
    """A device's id on its node (an agent names them cpu0, cuda0, ...)."""
    if not TOKEN_PATTERN.fullmatch(device_id):
        raise InvalidArgument(f"invalid device_id {shown(device_id)}: {_TOKEN_RULE}")


def is_valid_id(value: str) -> bool:
    return ID_PATTERN.fullmatch(value) is not None


def check_model_id(model_id: str) -> None:
    if not is_valid_id(model_id):
        raise InvalidArgument(f"invalid model_id {shown(model_id)}: {ID_RULE}")


def check_variant_name(name: str) -> None:
    """A compression variant's name follows the model id's rule (it names fingerprints
    and appears in deployment configurations)."""
    if not is_valid_id(name):
        raise InvalidArgument(f"invalid compression variant name {shown(name)}: {ID_RULE}")


# The ids Deploy gives: the model's id and 8 random hex digits.
_NEW_DEPLOYMENT_ID = re.compile(r".+-[0-9a-f]{8}")


def new_request_id() -> str:
    """An id for a request its client sent without one (``srv-`` and 12 hex digits), so
    that its log lines can be told apart and the client can quote it (they read
    "request - served …", a probe)."""
    return f"srv-{secrets.token_hex(6)}"


def new_deployment_id(model_id: str) -> str:
    """A fresh id for a deployment of ``model_id``."""
    return f"{model_id}-{secrets.token_hex(4)}"


def looks_like_deployment_id(value: str) -> bool:
    """Whether ``value`` has the shape :func:`new_deployment_id` gives (a model's id
    does not end in 8 hex digits after a '-' unless named so)."""
    return _NEW_DEPLOYMENT_ID.fullmatch(value) is not None


def no_deployment(model_id: str) -> str:
    """What a request for ``model_id`` gets when nothing serves it. One with a
    deployment id's shape may be a removed deployment's id (given as ``model`` to pin
    a request, the gateway's one field for it): the message says it is neither, the
    same whether such a deployment exists hidden from the caller or not at all."""
    if looks_like_deployment_id(model_id):
        return f"model {model_id} has no deployment, and no deployment has that id"
    return f"model {model_id} has no deployment"


def check_deployment_id(deployment_id: str) -> None:
    if TOKEN_PATTERN.fullmatch(deployment_id) is None:
        raise InvalidArgument(f"invalid deployment_id {shown(deployment_id)}: {_TOKEN_RULE}")


# Replica i > 0 of a deployment runs its workers and holds its memory under this suffix.
# Deployment ids end in "-<hex>", so no deployment id ends like a replica's group id.
_REPLICA = re.compile(r"(?P<deployment>.+)\.r(?P<index>[1-9][0-9]*)")


def replica_group_id(deployment_id: str, index: int) -> str:
    """The id replica ``index`` of a deployment goes by with agents and reservations:
    the deployment id itself for replica 0, ``<deployment id>.r<index>`` for others."""
    if index < 0:
        raise ValueError(f"a replica index is never negative, got {index}")
    return deployment_id if index == 0 else f"{deployment_id}.r{index}"


def split_group_id(group_id: str) -> tuple[str, int]:
    """(deployment id, replica index) of a worker group id: the inverse of
    :func:`replica_group_id`."""
    match = _REPLICA.fullmatch(group_id)
    if match is None:
        return group_id, 0
    return match["deployment"], int(match["index"])


def check_request_id(request_id: str) -> None:
    """A request id is optional (empty); given, it follows the deployment id's rule."""
    if request_id and TOKEN_PATTERN.fullmatch(request_id) is None:
        raise InvalidArgument(f"invalid request_id {shown(request_id)}: {_TOKEN_RULE}")


def cpu_hardware_type(machine: str) -> str:
    """The hardware type of a machine's CPUs as virtual devices: calibration is per
    hardware type, e.g. "cpu-x86_64" (``platform.machine()`` as it is)."""
    return f"cpu-{machine or 'unknown'}"


def is_cpu_hardware(hardware_type: str) -> bool:
    """Whether ``hardware_type`` names CPUs (virtual devices), not GPUs."""
    return hardware_type.startswith("cpu")


def check_hardware_type(hardware_type: str) -> None:
    if not is_valid_id(hardware_type):
        raise InvalidArgument(
            f"invalid hardware_type {shown(hardware_type)}: the type of the devices, "
            f"e.g. 'cpu-x86_64' or 'rtx-a6000' ({ID_RULE})"
        )
