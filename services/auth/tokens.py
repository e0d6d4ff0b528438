"""Bearer tokens: their format, how they are kept (hashed, in Redis) and how a presented
token becomes a :class:`Principal`.

A token iserve issues reads ``isv_<token id>_<secret>``: the id is public (``iserve token
list`` shows it, ``revoke`` takes it); the secret is 32 random bytes from :mod:`secrets`.
Redis keeps, under the id, the SHA-256 of the whole token and what it may do; a
presented token is looked up by its id and its hash compared with
:func:`hmac.compare_digest`, in constant time. Tokens an operator supplies
(the admin and service tokens of services.settings, e.g. from a Kubernetes Secret) may
be any printable string of 24-512 characters; their id is derived from their hash.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Protocol

from services.api import token_service_pb2 as token_pb
from services.auth import policy
from services.errors import FailedPrecondition, InvalidArgument, shown
from services.ids import check_deployment_id
from services.settings import (
    ADMIN_TOKEN_ENV,
    MAX_TOKEN_LENGTH,
    MIN_TOKEN_LENGTH,
    SERVICE_TOKEN_ENV,
    Settings,
)

PREFIX = "isv_"
ISSUED_TOKEN = re.compile(r"isv_([0-9a-f]{16})_[A-Za-z0-9_-]{20,}")
# Issued tokens' ids are 16 hex digits; supplied tokens' "s" and 15 (token_id_of).
_TOKEN_ID = re.compile(r"[0-9a-fs][0-9a-f]{15}")
MAX_GRANTS = 256

# How long a process trusts a token it found valid, and how many it remembers.
CACHE_S = 1.0
CACHE_ENTRIES = 10_000

_SUBJECT = re.compile(r"[A-Za-z0-9._@-]{1,64}")


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_id_of(token: str) -> str:
    """The public id of ``token``: the one an issued token carries, else one derived from
    its hash (operator-supplied tokens)."""
    match = ISSUED_TOKEN.fullmatch(token)
    return match.group(1) if match else "s" + digest(token)[:15]


def new_token() -> tuple[str, str]:
    """A fresh ``(token id, token)``."""
    token_id = secrets.token_hex(8)
    return token_id, f"{PREFIX}{token_id}_{secrets.token_urlsafe(32)}"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the holder of a valid token."""

    token_id: str
    subject: str
    role: int
    deployments: tuple[str, ...] = field(default=())

    @property
    def role_name(self) -> str:
        return policy.role_name(self.role)

    def describe(self) -> str:
        return f"{self.subject} ({self.role_name}, token {self.token_id})"


def check_subject(subject: str) -> str:
    if not _SUBJECT.fullmatch(subject):
        raise InvalidArgument(
            f"invalid subject {shown(subject)}: 1-64 characters of letters, digits, '.', '_', "
            "'-', '@'"
        )
    return subject


# The subjects of the supplied service and admin tokens (services.security). Records are
# owned by subject, so an issued token of either name would own, and may change, what
# the stack's own tokens made: a model developer named "admin" deleted the admin's model.
SERVICE_SUBJECT = "iserve"
ADMIN_SUBJECT = "admin"
RESERVED_SUBJECTS = (SERVICE_SUBJECT, ADMIN_SUBJECT)


def check_role(role: int) -> int:
    if role not in policy.ROLE_NAMES:
        names = ", ".join(policy.ROLE_NAMES.values())
        raise InvalidArgument(f"invalid role {role}: give one of {names}")
    return role


def check_grants(role: int, deployments) -> list[str]:
    """The deployments a token of ``role`` grants, each once; InvalidArgument unless an
    app-user token grants 1-MAX_GRANTS deployment ids (or "*") and no other role any."""
    grants = list(dict.fromkeys(deployments))
    if len(grants) > MAX_GRANTS:
        raise InvalidArgument(f"a token grants at most {MAX_GRANTS} deployments")
    for grant in grants:
        if grant != "*":
            check_deployment_id(grant)
    if grants and role != policy.APP_USER:
        raise InvalidArgument(
            "only app-user tokens grant deployments (developers use what they own)"
        )
    if role == policy.APP_USER and not grants:
        raise InvalidArgument("an app-user token must grant deployments (ids, or '*')")
    return grants


def check_token_id(token_id: str) -> str:
    """``token_id`` when it is a token's public id; InvalidArgument otherwise, which
    never quotes a value that may be a token itself (the message is logged: a revoke
    given the secret it meant to retire wrote it into the log)."""
    if _TOKEN_ID.fullmatch(token_id):
        return token_id
    if ISSUED_TOKEN.fullmatch(token_id):
        raise InvalidArgument(
            f"that is a token itself, not its id: its id is {token_id_of(token_id)} "
            "(the secret was not kept)"
        )
    if len(token_id) >= MIN_TOKEN_LENGTH:
        raise InvalidArgument(
            f"invalid token id (a {len(token_id)}-character value, not shown: it may be a "
            "token; an id is 16 hex digits): see `iserve token list`"
        )
    raise InvalidArgument(f"invalid token id {shown(token_id)}: see `iserve token list`")


def tokens_in_use(settings: Settings) -> dict[str, str]:
    """The ids of the tokens this stack runs on (its service and admin tokens, when
    authentication is on), each with the setting it comes from. Revoking one would lock
    every service, or the operator, out until a restart registered it again; they are
    rotated by their settings (docs/security.md)."""
    if not settings.auth:
        return {}
    given = ((SERVICE_TOKEN_ENV, settings.service_token), (ADMIN_TOKEN_ENV, settings.admin_token))
    return {token_id_of(token): setting for setting, token in given if token}


def check_issuing(authentication_off: bool) -> None:
    """FailedPrecondition on a stack that checks no token: anyone may call anything
    there, and a token it issued (an admin's, to a caller who sent none) would hold once
    authentication is turned on."""
    if authentication_off:
        raise FailedPrecondition(
            "this stack does not check tokens (ISERVE_AUTH is off), so it issues none: "
            "a token issued to anyone who asks would be valid once authentication is "
            "on; start the stack with ISERVE_AUTH=on and issue tokens with its admin "
            "token (docs/security.md)"
        )


def check_revocable(token_id: str, in_use: dict[str, str]) -> None:
    """FailedPrecondition, saying how to rotate it, for a token the stack runs on."""
    setting = in_use.get(token_id)
    if setting is not None:
        raise FailedPrecondition(
            f"token {token_id} is this stack's {setting}, which the services use: to "
            f"rotate it, set a new {setting}, restart the services, then revoke the "
            "old id"
        )


def token_info(
    token_id: str, subject: str, role: int, deployments: list[str] | tuple = ()
) -> token_pb.TokenInfo:
    """What the registry keeps of a token besides its hash, created now."""
    return token_pb.TokenInfo(
        token_id=token_id,
        subject=subject,
        role=role,
        deployments=deployments,
        created_at_unix_ms=int(time.time() * 1000),
    )


async def issue(
    records: TokenRecords, subject: str, role: int, deployments
) -> tuple[token_pb.TokenInfo, str]:
    """A new token for ``subject`` with ``role`` (checked), recorded hashed in
    ``records``: (what was recorded, the token itself, shown once)."""
    subject, role = check_subject(subject), check_role(role)
    # In any case: "Admin" owned nothing of admin's, but read as admin in `token list`
    # and in every refusal that names an owner.
    if subject.casefold() in RESERVED_SUBJECTS:
        raise InvalidArgument(
            f"subject {subject!r} is reserved for the stack's own {subject.casefold()} token: "
            "issue tokens to people or teams by their own names"
        )
    grants = check_grants(role, deployments)
    while True:  # a fresh id: 64 random bits, so a second draw is all but never needed
        token_id, token = new_token()
        info = token_info(token_id, subject, role, grants)
        if await records.put_token(info, digest(token)):
            return info, token


def principal_of(info: token_pb.TokenInfo) -> Principal:
    return Principal(info.token_id, info.subject, info.role, tuple(info.deployments))


class TokenRecords(Protocol):
    """Where tokens are kept (``services.state.store.StateStore``)."""

    async def get_token(self, token_id: str) -> tuple[token_pb.TokenInfo, str] | None: ...

    async def put_token(self, info: token_pb.TokenInfo, sha256: str) -> bool: ...


class Authenticator(Protocol):
    # What a refused caller is told of a token this authenticator does not know.
    unknown: str

    async def authenticate(self, token: str) -> Principal | None: ...


class StoreAuthenticator:
    """Resolves tokens against the registry in Redis (the control plane and agents).

    A token found valid is remembered for ``cache_s`` seconds (by its hash), so a client
    streaming many requests costs one Redis read a second, not one per call: a revoked
    token is refused within that time. Tokens not found are never remembered."""

    unknown = "invalid or revoked token"

    def __init__(self, records: TokenRecords, cache_s: float = CACHE_S, clock=time.monotonic):
        self.records = records
        self.cache_s = cache_s
        self._clock = clock
        self._valid: dict[str, tuple[Principal, float]] = {}

    async def authenticate(self, token: str) -> Principal | None:
        if not token or len(token) > MAX_TOKEN_LENGTH:
            return None
        hashed = digest(token)
        now = self._clock()
        cached = self._valid.get(hashed)
        if cached is not None and cached[1] > now:
            return cached[0]
        found = await self.records.get_token(token_id_of(token))
        if found is None or not hmac.compare_digest(hashed, found[1]):
            self._valid.pop(hashed, None)
            return None
        principal = principal_of(found[0])
        if len(self._valid) >= CACHE_ENTRIES:
            self._valid = {k: v for k, v in self._valid.items() if v[1] > now}
        if len(self._valid) < CACHE_ENTRIES:
            self._valid[hashed] = (principal, now + self.cache_s)
        return principal


class ServiceTokenAuthenticator:
    """Knows only the service token (workers, which hold no connection to Redis)."""

    unknown = (
        "not the stack's service token: a worker answers only the services "
        "(ISERVE_SERVICE_TOKEN); clients generate through the scheduler or the gateway"
    )

    def __init__(self, service_token: str):
        self._hash = digest(service_token)
        self._principal = Principal(token_id_of(service_token), "iserve", policy.SERVICE)

    async def authenticate(self, token: str) -> Principal | None:
        if not token or len(token) > MAX_TOKEN_LENGTH:
            return None
        if hmac.compare_digest(digest(token), self._hash):
            return self._principal
        return None


# What can be an iserve token (``isv_...``, or an operator's 24-512 characters) in the
# printable ASCII without spaces that gRPC metadata carries.
_TOKEN_SHAPE = re.compile(rf"[!-~]{{{MIN_TOKEN_LENGTH},{MAX_TOKEN_LENGTH}}}")


def could_be_token(text: str) -> bool:
    """Whether ``text`` has the shape of a token a call can carry (not whether one is
    registered)."""
    return _TOKEN_SHAPE.fullmatch(text) is not None


def authorization_entries(metadata: object) -> int:
    """How many ``authorization`` entries gRPC metadata carries. More than one is
    refused: which of them a proxy in front acts on (the last, say) is not the one a
    service would (the first Bearer), so two principals could each be the caller."""
    return sum(1 for k, _ in (metadata or ()) if k == "authorization")


def bearer(metadata: object) -> str:
    """The token of an ``authorization: Bearer <token>`` entry of gRPC metadata (or an
    HTTP header value), or ""."""
    if isinstance(metadata, str):
        values = [metadata]
    else:
        values = [v for k, v in (metadata or ()) if k == "authorization"]
    for value in values:
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer":
            return token.strip()
    return ""
