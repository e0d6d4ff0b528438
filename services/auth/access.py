"""Ownership rules, applied by servicers to the caller the interceptor let in.

The interceptor (:mod:`services.auth.interceptor`) sets :func:`caller` for the duration
of each call. With authentication off every call is made by :data:`ANONYMOUS`, an
administrator with no subject, so these checks pass and records get no owner.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable

from services.auth import policy
from services.auth.tokens import Principal
from services.errors import IServeError, PermissionDenied

ANONYMOUS = Principal(token_id="", subject="", role=policy.ADMIN, deployments=("*",))
_caller: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "iserve_caller", default=ANONYMOUS
)
# Roles that act on everything, whoever owns it.
_UNRESTRICTED = frozenset({policy.ADMIN, policy.SERVICE})


def caller() -> Principal:
    """Who makes the current call (ANONYMOUS with authentication off)."""
    return _caller.get()


def set_caller(principal: Principal) -> contextvars.Token:
    return _caller.set(principal)


def reset_caller(token: contextvars.Token) -> None:
    _caller.reset(token)


def owner() -> str:
    """The owner recorded on what the current call creates: the caller's subject."""
    return caller().subject


def check_owner(what: str, owner_subject: str) -> None:
    """PermissionDenied unless the caller may change ``what``, owned by ``owner_subject``:
    administrators and services may change anything; others only what they own."""
    who = caller()
    if who.role in _UNRESTRICTED or (owner_subject and who.subject == owner_subject):
        return
    owned = f"is owned by {owner_subject}" if owner_subject else "has no owner"
    raise PermissionDenied(f"{what} {owned}; {who.describe()} may change only its own")


def may_use(deployment_id: str, owner_subject: str) -> bool:
    """Whether the caller may see and generate on a deployment: administrators and
    services any; application developers those they own; application users those their
    token grants (``*``: all)."""
    who = caller()
    if who.role in _UNRESTRICTED:
        return True
    if who.role == policy.APP_DEVELOPER:
        return bool(owner_subject) and who.subject == owner_subject
    if who.role == policy.APP_USER:
        return "*" in who.deployments or deployment_id in who.deployments
    return False


def check_use(deployment_id: str, owner_subject: str, *, unknown: IServeError) -> None:
    """Nothing when :func:`may_use`; else ``unknown`` (the error a deployment that does
    not exist gets) for an application user, which sees only what its token grants and
    so must not learn that other deployments exist, and PermissionDenied for others."""
    if may_use(deployment_id, owner_subject):
        return
    if caller().role == policy.APP_USER:
        raise unknown
    raise PermissionDenied(
        f"{caller().describe()} may not use deployment {deployment_id} (a developer must own it)"
    )


def may_see(deployment_id: str, owner_subject: str) -> bool:
    """Whether the caller may read a deployment's record: every role but application
    users, which see the deployments their token grants (:func:`may_use`)."""
    return caller().role != policy.APP_USER or may_use(deployment_id, owner_subject)


def check_see(deployment_id: str, owner_subject: str, *, unknown: IServeError) -> None:
    """Nothing when :func:`may_see`; else ``unknown``, as for a deployment that does
    not exist (only application users are refused, and they must not learn that it
    does)."""
    if not may_see(deployment_id, owner_subject):
        raise unknown


def usable(deployments: Iterable) -> list:
    """The deployments (records with ``deployment_id`` and ``owner``) the caller may
    generate on (:func:`may_use`)."""
    return [d for d in deployments if may_use(d.deployment_id, d.owner)]


def check_may_generate() -> None:
    """PermissionDenied unless the caller's role may generate through the scheduler at
    all (a service token calls workers, a model developer nothing): only then does any
    deployment count as one it may use in a listing of them (a service token's
    /v1/models listed models each of which then refused it generation; a tester)."""
    if caller().role not in (policy.roles_for(policy.GENERATE) or frozenset()):
        raise PermissionDenied(
            f"{caller().describe()} generates on no deployment: usable_only lists those "
            "the caller may generate on"
        )


def visible(deployments: Iterable) -> list:
    """The deployments (records with ``deployment_id`` and ``owner``) the caller may see:
    all for developers, administrators and services; the granted ones for users."""
    return [d for d in deployments if may_see(d.deployment_id, d.owner)]


def may_read_deployments() -> bool:
    """Whether the caller's role may read deployment records at all (GetDeployment's
    roles): model developers manage models and see devices, not deployments."""
    roles = policy.roles_for(policy.READ_DEPLOYMENT) or frozenset()
    return caller().role in _UNRESTRICTED or caller().role in roles


def readable(deployments: Iterable) -> list:
    """The deployment records the caller may read wherever they appear (a listing, the
    cluster's state): :func:`visible` ones for a role that may read deployments, none
    for others."""
    return visible(deployments) if may_read_deployments() else []
