"""Process settings, read from environment variables.

Every iserve process (services, agent, CLI) reads the same variables:

==========================  ==============================================  =====================
variable                    meaning                                         default
==========================  ==============================================  =====================
``ISERVE_STATE_DIR``        where ``iserve up`` keeps addresses, logs,      ``~/.iserve``
                            pids and the embedded Redis's data
``ISERVE_MODELS_ROOT``      the only directory checkpoints are read from    ``$ISERVE_STATE_DIR/models``
``REDIS_URL``               Redis to use; unset: ``iserve up`` embeds one   from ``stack.json``
``ISERVE_REDIS_PORT``       the embedded Redis's port (127.0.0.1 only)       a free one, kept
                                                                            across restarts
``ISERVE_HOST``             interface services bind to                      ``127.0.0.1``
``ISERVE_MODEL_ADDR``       ModelService address                            ``$ISERVE_HOST:50061``
``ISERVE_ESTIMATOR_ADDR``   EstimatorService address                        ``$ISERVE_HOST:50062``
``ISERVE_DEPLOY_ADDR``      DeploymentService address                       ``$ISERVE_HOST:50063``
``ISERVE_SCHEDULER_ADDR``   InferenceService address                        ``$ISERVE_HOST:50064``
``ISERVE_AGENT_ADDR``       this node's AgentService address                ``$ISERVE_HOST:50065``
``ISERVE_<S>_METRICS_ADDR``  where service ``<S>`` (MODEL, ESTIMATOR,         ``$ISERVE_HOST:9461``
                            DEPLOY, SCHEDULER, AGENT) serves Prometheus      … ``9465``
                            text at ``/metrics`` (port 0: any free port)
``ISERVE_NODE_ID``          this node's id                                  ``node0``
``ISERVE_DEVICES``          virtual CPU devices when no GPU is found        ``2``
                            (at most 256)
``ISERVE_DEVICE_MEMORY_GIB``memory budget of each virtual CPU device        ``4``
``ISERVE_QUEUE_CAPACITY``   requests waiting per deployment before          ``64``
                            RESOURCE_EXHAUSTED
``ISERVE_READY_TIMEOUT_S``  how long Deploy waits for workers to be ready   ``120``
``ISERVE_HEARTBEAT_TTL_S``  agent heartbeat lifetime                        ``5``
``ISERVE_MAX_RESTARTS``     restarts in a row of a failed replica before    ``5``
                            it is given up (0: never restarted)
``ISERVE_RESTART_BACKOFF_S``the wait before a first restart, doubling up    ``1``
                            to 30 s (or itself, if longer)
``ISERVE_NODE_FORGET_AFTER_S`` how long a dead node (its heartbeat gone,  ``3600``
                            no memory reserved on it) stays listed before
                            the deployer forgets it (0: listed for ever)
``ISERVE_DRAIN_TIMEOUT_S``  on SIGTERM, how long the scheduler (and a        ``30``
                            stopped worker) lets streams in flight finish
                            before it cancels them and exits
``ISERVE_LOG_LEVEL``        logging level                                   ``INFO``
``ISERVE_CPU_COLLECTIVES``  how CPU ranks of one host exchange: ``shm``     ``shm``
                            (shared memory) or ``gloo``
``ISERVE_GATEWAY_ADDR``     the OpenAI-compatible HTTP gateway              ``$ISERVE_HOST:8000``
``ISERVE_CORS_ORIGINS``     web origins whose pages may call the gateway     none
                            (CORS), comma-separated: ``*`` or
                            ``http(s)://host[:port]``
``ISERVE_WORKER_POOL``      ``1``: the agent forks workers from a warm       ``1``
                            process that has imported torch; ``0``: each
                            worker is a fresh ``python`` process
``ISERVE_WORKER_PORTS``     the ports the agent's workers serve on, ``LOW-   any free port
                            HIGH`` (inclusive), for a firewall between
                            nodes; each worker takes a free one of them
``ISERVE_ENGINE``           the engine the agent picks for a deployment's   ``auto``
                            group (``pytorch``, ``tensorrt_llm`` or
                            ``auto``: TensorRT-LLM when ``tensorrt_llm``
                            imports, every device is a GPU, the node runs
                            the whole group and the configuration maps to
                            it; else PyTorch), see docs/engine.md
==========================  ==============================================  =====================

Authentication and TLS (docs/security.md):

==========================  ==============================================  =====================
variable                    meaning                                         default
==========================  ==============================================  =====================
``ISERVE_AUTH``             ``on``: every RPC needs a bearer token with a    ``off``
                            role that may call it; ``off``: open (logged
                            loudly at start)
``ISERVE_TOKEN``            the token this CLI or client sends               ``$STATE/tokens/admin``
``ISERVE_SERVICE_TOKEN``    the token iserve's processes send each other     ``$STATE/tokens/service``
``ISERVE_ADMIN_TOKEN``      an administrator token each service registers    ``$STATE/tokens/admin``
                            at start (the first token of a new cluster)
``ISERVE_TLS_CERT``         PEM certificate chain this process presents      none: plaintext
``ISERVE_TLS_KEY``          its private key                                  none
``ISERVE_TLS_CA``           PEM CA bundle that verifies peers                system roots
``ISERVE_TLS_CLIENT_AUTH``  ``on``: servers require client certificates      ``off``
                            signed by ``ISERVE_TLS_CA`` (mutual TLS)
``ISERVE_TLS_SERVER_NAME``  the name clients expect in server certificates   the address's host
==========================  ==============================================  =====================

``iserve up`` with ``ISERVE_AUTH=on`` writes ``$ISERVE_STATE_DIR/tokens/admin`` and
``…/service`` (mode 0600) when they are absent.

The ModelService's profiling jobs (:class:`ProfilingSettings`):

==================================  ===============================  =======
variable                            meaning                          default
==================================  ===============================  =======
``ISERVE_PROFILE_INPUT_TOKENS``     prompt lengths, comma-separated  64,256,1024
``ISERVE_PROFILE_OUTPUT_TOKENS``    output lengths, comma-separated  8,16
``ISERVE_PROFILE_BATCH_SIZES``      batch sizes, comma-separated     1,2
``ISERVE_PROFILE_WARMUP_RUNS``      untimed runs before timing       1
``ISERVE_PROFILE_TIMED_RUNS``       timed runs (medians are kept)    3
==================================  ===============================  =======

An ``ISERVE_*`` variable that is none of these (nor compose.yaml's) is warned of, with the
nearest name, by ``iserve up`` and in each service's log: a misspelt one is otherwise
ignored and its default used.

Addresses not set in the environment are taken from ``$ISERVE_STATE_DIR/stack.json``
(written by ``iserve up``) when it exists, else the defaults above.
"""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import json
import math
import os
import re
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.connection import ConnectionPool, parse_url

from services.files import write_private
from services.ids import NODE_ID_PATTERN, NODE_ID_RULE

DEFAULT_PORTS = {
    "model": 50061,
    "estimator": 50062,
    "deploy": 50063,
    "scheduler": 50064,
    "agent": 50065,
}
SERVICE_ENV = {
    "model": "ISERVE_MODEL_ADDR",
    "estimator": "ISERVE_ESTIMATOR_ADDR",
    "deploy": "ISERVE_DEPLOY_ADDR",
    "scheduler": "ISERVE_SCHEDULER_ADDR",
    "agent": "ISERVE_AGENT_ADDR",
}
# Prometheus ports sit outside the kernel's ephemeral range (32768-60999 on Linux), so a
# client's outgoing connection never holds one when its service starts.
DEFAULT_METRICS_PORTS = {
    "model": 9461,
    "estimator": 9462,
    "deploy": 9463,
    "scheduler": 9464,
    "agent": 9465,
}
METRICS_ENV = {name: f"ISERVE_{name.upper()}_METRICS_ADDR" for name in DEFAULT_METRICS_PORTS}
STACK_FILE = "stack.json"
# Virtual CPU devices one agent may present (ISERVE_DEVICES, `iserve up --devices`).
MAX_VIRTUAL_DEVICES = 256
GIB = 1 << 30
GATEWAY_ENV = "ISERVE_GATEWAY_ADDR"
CORS_ENV = "ISERVE_CORS_ORIGINS"
# Set by `iserve up` in every service's environment (and so in the workers'): the stack
# a process belongs to, by which `iserve down` finds one no record names (a service
# started but not yet recorded when `iserve up` was killed). Not for operators to set.
STACK_ID_ENV = "ISERVE_STACK_ID"
DEFAULT_GATEWAY_PORT = 8000
DEFAULT_GATEWAY_ADDR = f"127.0.0.1:{DEFAULT_GATEWAY_PORT}"
DRAIN_TIMEOUT_ENV = "ISERVE_DRAIN_TIMEOUT_S"
WORKER_PORTS_ENV = "ISERVE_WORKER_PORTS"
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# The deployer's restart policy (deploy_svc.healing.RestartPolicy's defaults too).
DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_BACKOFF_S = 1.0
# How long the deployer lists a dead node before it forgets it (0: for ever).
DEFAULT_NODE_FORGET_AFTER_S = 3600.0


@dataclass(frozen=True)
class Settings:
    state_dir: Path
    models_root: Path
    redis_url: str | None
    host: str
    addresses: Mapping[str, str]
    metrics_addresses: Mapping[str, str]
    node_id: str
    virtual_devices: int
    device_memory_bytes: int
    queue_capacity: int
    ready_timeout_s: float
    heartbeat_ttl_s: float
    log_level: str
    drain_timeout_s: float
    worker_pool: bool = True
    # The ports workers serve on (ISERVE_WORKER_PORTS); None: any free port.
    worker_ports: range | None = None
    # The deployer's restart policy (deploy_svc.healing.RestartPolicy.of).
    max_restarts: int = DEFAULT_MAX_RESTARTS
    restart_backoff_s: float = DEFAULT_RESTART_BACKOFF_S
    node_forget_after_s: float = DEFAULT_NODE_FORGET_AFTER_S
    gateway_address: str = DEFAULT_GATEWAY_ADDR
    # Web origins whose pages may call the gateway (ISERVE_CORS_ORIGINS); () none.
    cors_origins: tuple[str, ...] = ()
    auth: bool = False
    # The bearer token this process sends (ISERVE_TOKEN); "" none.
    token: str = field(default="", repr=False)
    service_token: str = field(default="", repr=False)
    admin_token: str = field(default="", repr=False)
    tls: TlsFiles | None = None
    # The embedded Redis's port (ISERVE_REDIS_PORT); 0: a free one, kept across restarts.
    redis_port: int = 0

    def address(self, service: str) -> str:
        """host:port of ``service`` (one of ``DEFAULT_PORTS``)."""
        return self.addresses[service]

    def metrics_address(self, service: str) -> str:
        """host:port where ``service`` serves its Prometheus metrics."""
        return self.metrics_addresses[service]

    def metrics_url(self, service: str) -> str:
        """The URL of ``service``'s metrics: HTTPS where this process serves TLS; "-"
        where its port is 0 (any free one, chosen when it starts: with no stack
        recorded, none to show)."""
        address = self.metrics_address(service)
        if address.endswith(":0"):
            return "-"
        scheme = "https" if self.tls is not None and self.tls.serves else "http"
        return f"{scheme}://{address}/metrics"

    def as_recorded(self) -> Settings:
        """These settings with each "host:0" address (a server binds any free port) read
        from what ``iserve up`` recorded in stack.json, where it names the port chosen:
        what a client needs, not a server (which binds host:0 as given)."""
        stack = read_stack_file(self.state_dir)

        def recorded(given: str, found: str | None) -> str:
            return found if given.endswith(":0") and found else given

        addresses, metrics = stack.get("addresses", {}), stack.get("metrics_addresses", {})
        return replace(
            self,
            addresses={n: recorded(a, addresses.get(n)) for n, a in self.addresses.items()},
            metrics_addresses={
                n: recorded(a, metrics.get(n)) for n, a in self.metrics_addresses.items()
            },
            gateway_address=recorded(self.gateway_address, stack.get("gateway_address")),
        )

    def require_service_token(self) -> str:
        """The service token, which authentication needs; ValueError saying how to set it."""
        if not self.service_token:
            raise ValueError(
                "ISERVE_AUTH=on needs ISERVE_SERVICE_TOKEN (or `iserve up`, which writes "
                f"{token_file(self.state_dir, 'service')})"
            )
        return self.service_token

    def with_overrides(self, **changes: object) -> Settings:
        return replace(self, **changes)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a process's TLS identity and the CA it trusts."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    client_auth: bool = False
    server_name: str = ""
    # When ``cert`` expires (Unix seconds), as the handshake check read it; None without
    # a certificate.
    expires_at: float | None = field(default=None, compare=False)

    @property
    def serves(self) -> bool:
        """Whether a server of this process can listen with TLS."""
        return self.cert is not None and self.key is not None


TOKENS_DIR = "tokens"
AUTH_ENV = "ISERVE_AUTH"
SERVICE_TOKEN_ENV = "ISERVE_SERVICE_TOKEN"
ADMIN_TOKEN_ENV = "ISERVE_ADMIN_TOKEN"
# What an agent's environment holds that none of its engine workers needs, and none
# should hold: Redis's URL with its password (whoever reaches Redis owns the cluster; a
# worker loads checkpoints and joins torch collectives that have no authentication) and
# the tokens a client sends. A worker accepts and sends the service token alone.
WITHHELD_FROM_WORKERS = ("REDIS_URL", "ISERVE_TOKEN", ADMIN_TOKEN_ENV)
# What the gateway's environment need not hold: it reaches Redis never, and the admin
# token never (it calls the services with the service token); a template file it reads
# for a chat cannot show them even if it were a link to /proc/self/environ.
WITHHELD_FROM_GATEWAY = ("REDIS_URL", ADMIN_TOKEN_ENV)


def token_file(state_dir: Path, name: str) -> Path:
    """Where ``iserve up`` keeps the ``admin`` or ``service`` token of its stack."""
    return state_dir / TOKENS_DIR / name


MIN_TOKEN_LENGTH = 24
MAX_TOKEN_LENGTH = 512


def stack_token(state_dir: Path, name: str) -> str:
    """The ``admin`` or ``service`` token ``iserve up`` wrote in ``state_dir`` ("" none),
    checked as a token given in the environment is."""
    return _token({}, f"ISERVE_{name.upper()}_TOKEN", state_dir, name)


def _token(env: Mapping[str, str], variable: str, state_dir: Path, file_name: str) -> str:
    """``env[variable]``, else the stack's token file; ValueError naming the variable
    (or file) when it is too short or long, or holds spaces or control characters."""
    value = env.get(variable, "").strip()
    source = variable
    if not value:
        path = token_file(state_dir, file_name)
        try:
            value = path.read_text().strip()
        except OSError:
            return ""
        source = str(path)
    if not MIN_TOKEN_LENGTH <= len(value) <= MAX_TOKEN_LENGTH:
        raise ValueError(
            f"{source}: a token is {MIN_TOKEN_LENGTH}-{MAX_TOKEN_LENGTH} characters "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    if any(c.isspace() or not c.isprintable() or not c.isascii() for c in value):
        # gRPC metadata and HTTP headers carry ASCII: another token could never be sent.
        raise ValueError(f"{source}: a token is printable ASCII and has no spaces")
    return value


def _tls(env: Mapping[str, str]) -> TlsFiles | None:
    """The ISERVE_TLS_* files; None when none is set. ValueError naming a variable whose
    file does not exist, or a certificate given without its key."""
    paths: dict[str, Path | None] = {}
    for part in ("cert", "key", "ca"):
        variable = f"ISERVE_TLS_{part.upper()}"
        raw = env.get(variable, "").strip()
        path = Path(raw).expanduser() if raw else None
        if path is not None and not path.is_file():
            raise ValueError(f"{variable}={raw!r}: no such file")
        if path is not None:
            try:
                with path.open("rb") as file:
                    file.read(1)
            except OSError as exc:
                raise ValueError(
                    f"{variable}={raw!r}: cannot be read ({exc.strerror or exc})"
                ) from None
        paths[part] = path
    client_auth = _flag(env, "ISERVE_TLS_CLIENT_AUTH", False)
    if not any(paths.values()):
        if client_auth:
            raise ValueError("ISERVE_TLS_CLIENT_AUTH=on needs ISERVE_TLS_CERT, _KEY and _CA")
        return None
    if (paths["cert"] is None) != (paths["key"] is None):
        raise ValueError("ISERVE_TLS_CERT and ISERVE_TLS_KEY go together: set both or neither")
    if client_auth and (paths["ca"] is None or paths["cert"] is None):
        raise ValueError("ISERVE_TLS_CLIENT_AUTH=on needs ISERVE_TLS_CERT, _KEY and _CA")
    _check_pem(paths["cert"], paths["key"], paths["ca"])
    if paths["ca"] is not None:
        _check_ca_dates(paths["ca"])
    return TlsFiles(
        paths["cert"],
        paths["key"],
        paths["ca"],
        client_auth,
        env.get("ISERVE_TLS_SERVER_NAME", "").strip(),
    )


def check_tls_identity(settings: Settings, serving: bool) -> Settings:
    """``settings`` with when the certificate expires (``TlsFiles.expires_at``), once a
    handshake in memory shows it does what this process uses it for. ``serving``: a
    process that serves (a service, `iserve up`) presents it as a server and, under
    mutual TLS, as a client to the others; a client (the CLI, the gateway, which serves
    plain HTTP) presents it only under mutual TLS, as a client certificate, which may be
    made for clients alone. ValueError naming what fails (see ``_check_handshake``)."""
    tls = settings.tls
    if tls is None or tls.cert is None or tls.key is None:
        return settings
    if not serving and not tls.client_auth:
        return settings  # a client that presents no certificate
    expires_at = _check_handshake(tls.cert, tls.key, tls.ca, tls.client_auth, serving)
    return settings.with_overrides(tls=replace(tls, expires_at=expires_at))


# OpenSSL's X509_V_ERR_* codes of a failed verification that say what to do.
_CERT_NOT_YET_VALID, _CERT_HAS_EXPIRED = 9, 10
_UNTRUSTED = {2, 18, 19, 20, 21}  # no issuer found, self-signed, issuer not in the CA file


def _check_ca_dates(ca: Path) -> None:
    """ValueError when no certificate in ISERVE_TLS_CA is valid now (all expired, or
    not valid yet): no peer's certificate could be verified."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=str(ca))
    now = time.time()
    spans = [
        (ssl.cert_time_to_seconds(c["notBefore"]), ssl.cert_time_to_seconds(c["notAfter"]))
        for c in context.get_ca_certs()
        if "notBefore" in c and "notAfter" in c
    ]
    if spans and not any(start <= now <= end for start, end in spans):
        latest = max(end for _, end in spans)
        state = (
            f"expired on {_utc(latest)}"
            if latest < now
            else f"is not valid before {_utc(min(s for s, _ in spans))}"
        )
        raise ValueError(
            f"ISERVE_TLS_CA={str(ca)!r}: its CA certificate {state}, so no peer can be "
            "verified: give the CA's current certificate"
        )


def _utc(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(unix_s))


def _check_handshake(
    cert: Path, key: Path, ca: Path | None, client_auth: bool, serving: bool = True
) -> float:
    """When ``cert`` expires (Unix seconds). ValueError when the first handshake between
    iserve's processes, which present ``cert`` to each other, would fail: the
    certificate expired or not valid yet, not issued by ISERVE_TLS_CA (the system's roots
    without it), or not made for TLS servers (nor clients, under mutual TLS). Found by a
    handshake in memory between the two ends OpenSSL builds from these files (gRPC's
    BoringSSL checks the same); without it every call fails with an UNAVAILABLE that
    names no file. ``serving`` False: ``cert`` is checked as a client certificate alone
    (the server end presents it too, unchecked)."""
    server, client = _handshake_contexts(cert, key, ca)
    client.check_hostname = False  # the name is ISERVE_TLS_SERVER_NAME's, per address
    if ca is None:
        against = "a CA among the system's root certificates (ISERVE_TLS_CA is not set)"
    else:
        against = f"the CA in ISERVE_TLS_CA={str(ca)!r}"
    if not serving:
        client.verify_mode = ssl.CERT_NONE
    if client_auth:
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_verify_locations(cafile=str(ca))
        client.load_cert_chain(str(cert), str(key), password=_no_passphrase)
    ends = _Ends(client, server)
    try:
        ends.handshake()
    except ssl.SSLCertVerificationError as exc:
        role = ends.failed_role
        name = f"ISERVE_TLS_CERT={str(cert)!r}"
        if exc.verify_code == _CERT_HAS_EXPIRED:
            problem = "has expired (or a certificate in its chain has)"
        elif exc.verify_code == _CERT_NOT_YET_VALID:
            problem = "is not valid yet (or a certificate in its chain is not)"
        elif exc.verify_code in _UNTRUSTED:
            problem = f"is not issued by {against} ({exc.verify_message})"
        else:
            problem = f"is refused as a TLS {role} certificate ({exc.verify_message})"
        consequence = (
            "every connection between iserve's processes, which present it to each other, "
            "would fail"
            if serving
            else "the stack's servers would refuse every call this client makes with it"
        )
        raise ValueError(f"{name} {problem}: {consequence}") from None
    except ssl.SSLError as exc:
        raise ValueError(
            f"ISERVE_TLS_CERT={str(cert)!r} with ISERVE_TLS_KEY={str(key)!r}: a TLS "
            f"handshake between two ends with these files fails ({exc})"
        ) from None
    verifier = ends.client if serving else ends.server
    return ssl.cert_time_to_seconds(verifier.getpeercert()["notAfter"])


def _no_passphrase() -> bytes:
    """The passphrase OpenSSL gets instead of prompting on the terminal."""
    return b""


def _handshake_contexts(
    cert: Path, key: Path, ca: Path | None
) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for a handshake in memory: the server presents ``cert``,
    the client trusts ``ca`` (the system's roots without it) and checks host names."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(cert), str(key), password=_no_passphrase)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca is None:
        client.load_default_certs()
    else:
        client.load_verify_locations(cafile=str(ca))
    return server, client


class _Ends:
    """Two ends of a TLS connection in memory (no socket), built from ``client`` and
    ``server`` contexts; ``server_hostname`` is the name the client checks, if it does."""

    def __init__(
        self, client: ssl.SSLContext, server: ssl.SSLContext, server_hostname: str | None = None
    ):
        self._bios = [ssl.MemoryBIO() for _ in range(4)]
        client_in, client_out, server_in, server_out = self._bios
        self.client = client.wrap_bio(client_in, client_out, server_hostname=server_hostname)
        self.server = server.wrap_bio(server_in, server_out, server_side=True)
        self.failed_role = ""

    def handshake(self) -> None:
        """Run both handshakes to their end; the ssl error of the first that fails, with
        ``failed_role`` the role of the certificate it refused ("server": the client end
        refused the server's)."""
        client_in, client_out, server_in, server_out = self._bios
        # What the refused certificate is to the end that verifies it -> that end.
        pending = {"server": self.client, "client": self.server}
        for _ in range(8):
            for role, end in list(pending.items()):
                self.failed_role = role
                with contextlib.suppress(ssl.SSLWantReadError):
                    end.do_handshake()
                    del pending[role]
            server_in.write(client_out.read())
            client_in.write(server_out.read())
            if not pending:
                return


# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH.
_NAME_MISMATCH = {62, 64}
# Bind-everywhere hosts: a server bound to one listens on every interface, and nobody
# dials one (no certificate names it; a worker bound so is advertised by the host name).
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address, ``[::1]`` too, or ``localhost``) is this host's
    loopback: what processes on other hosts cannot dial."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def certificate_name_warnings(settings: Settings, dialed: Mapping[str, str]) -> list[str]:
    """For a process that serves with ``ISERVE_TLS_CERT``: the names in ``dialed`` (the
    variable that names an address -> that address) that its certificate does not
    carry, so that every client dialling them fails its hostname check (gRPC:
    "Hostname Verification Check failed"). The name checked is ISERVE_TLS_SERVER_NAME
    where it is set, else the address's host; OpenSSL decides the match (Python's
    ``ssl``, in a handshake in memory, with the name as a client sends it). A warning,
    not a refusal: on several nodes the names others dial may differ from these."""
    tls = settings.tls
    if tls is None or not tls.serves:
        return []
    hosts: dict[str, list[str]] = {}
    for variable, address in dialed.items():
        host = tls.server_name or address.rpartition(":")[0].strip("[]")
        if host not in WILDCARD_HOSTS:
            hosts.setdefault(host, []).append(variable)
    warnings = []
    for host, variables in hosts.items():
        server, client = _handshake_contexts(tls.cert, tls.key, tls.ca)
        try:
            _Ends(client, server, server_hostname=host).handshake()
        except ssl.SSLCertVerificationError as exc:
            if exc.verify_code not in _NAME_MISMATCH:
                continue  # refused for another reason, which check_tls_identity names
            source = (
                "ISERVE_TLS_SERVER_NAME"
                if tls.server_name
                else f"the host of {', '.join(sorted(variables))}"
            )
            warnings.append(
                f"ISERVE_TLS_CERT={str(tls.cert)!r} does not name {host!r} ({source}): "
                "clients that dial it fail the certificate's hostname check; add it to "
                "the certificate's subjectAltName, or set ISERVE_TLS_SERVER_NAME to a name "
                "the certificate has"
            )
        except ssl.SSLError:
            continue
    return warnings


# How long before its certificate expires a process says so when it starts.
TLS_EXPIRY_WARNING_S = 14 * 86400


def tls_warnings(settings: Settings, now: float | None = None) -> list[str]:
    """What to tell an operator about this process's TLS files when it starts: a
    certificate that expires within TLS_EXPIRY_WARNING_S."""
    tls = settings.tls
    if tls is None or tls.expires_at is None:
        return []
    left = tls.expires_at - (time.time() if now is None else now)
    if left > TLS_EXPIRY_WARNING_S:
        return []
    return [
        f"ISERVE_TLS_CERT={str(tls.cert)!r} expires on {_utc(tls.expires_at)} (in "
        f"{left / 86400:.1f} days): new connections between iserve's processes fail from "
        "then on; renew it and restart the stack"
    ]


def _check_pem(cert: Path | None, key: Path | None, ca: Path | None) -> None:
    """ValueError naming the variable whose file OpenSSL (Python's ``ssl``, the library
    gRPC's TLS builds on too) cannot read as what it is set for: PEM certificates for
    ISERVE_TLS_CA and _CERT, the certificate's own unencrypted private key for _KEY.
    Without this the first handshake fails with a message that names no file."""
    for variable, path in (("ISERVE_TLS_CA", ca), ("ISERVE_TLS_CERT", cert)):
        if path is None:
            continue
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(path))
        except (ssl.SSLError, UnicodeDecodeError) as exc:
            what = "CA certificate" if variable == "ISERVE_TLS_CA" else "certificate"
            raise ValueError(f"{variable}={str(path)!r}: not a PEM {what} ({exc})") from None
    if cert is None or key is None:
        return
    _check_key(key)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
            str(cert), str(key), password=_no_passphrase
        )
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"ISERVE_TLS_KEY={str(key)!r} does not match ISERVE_TLS_CERT={str(cert)!r}: "
                "give the private key the certificate was issued for"
            ) from None
        raise ValueError(
            f"ISERVE_TLS_KEY={str(key)!r}: not a PEM private key, or an encrypted one "
            f"(gRPC reads unencrypted keys) ({exc})"
        ) from None


# The elliptic curves gRPC's TLS (BoringSSL) signs with.
GRPC_CURVES = ("secp256r1", "secp384r1", "secp521r1")


def _check_key(key: Path) -> None:
    """ValueError when ISERVE_TLS_KEY is a key gRPC's TLS cannot use, though OpenSSL
    (Python's ``ssl``, which the handshake check runs on) can: an encrypted one (even
    with an empty passphrase: gRPC reads unencrypted keys, and OpenSSL asked for the
    passphrase on the terminal), an Ed25519 or Ed448 one (BoringSSL signs no TLS
    handshake with them: NO_COMMON_SIGNATURE_ALGORITHMS at every call), or an elliptic
    curve other than P-256, P-384 and P-521. Read by ``cryptography``, the library that
    parses every key format; a key it cannot read is left to the checks that follow."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519

    name = f"ISERVE_TLS_KEY={str(key)!r}"
    try:
        private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except TypeError:  # "Password was not given but private key is encrypted"
        raise ValueError(
            f"{name}: an encrypted key; gRPC reads unencrypted keys only: write it out "
            "unencrypted (e.g. `openssl pkey -in KEY -out KEY.plain`) and keep its file "
            "to this process's user"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        return
    if isinstance(private, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey | dsa.DSAPrivateKey):
        kind = type(private).__name__.removesuffix("PrivateKey").lstrip("_")
        article = "an" if kind[0] in "AEIOU" else "a"
        raise ValueError(
            f"{name}: {article} {kind} key; gRPC's TLS signs with RSA and ECDSA (P-256, P-384, "
            "P-521) keys only, and every handshake would fail: issue the certificate for one"
        )
    if isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name not in GRPC_CURVES:
        raise ValueError(
            f"{name}: an elliptic-curve key on {private.curve.name}; gRPC's TLS signs on "
            "P-256, P-384 and P-521 only, and every handshake would fail: issue the "
            "certificate for one of those"
        )


def _number(
    env: Mapping[str, str],
    name: str,
    default: float,
    kind: type = int,
    minimum: int | None = None,
    maximum: float | None = None,
) -> float:
    """``env[name]`` as a ``kind``, ``default`` when unset; ValueError naming the variable
    when it is not a finite number, not positive (``minimum`` None), below ``minimum``
    or above ``maximum``."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError as exc:
        expected = "an integer" if kind is int else "a number"
        raise ValueError(f"{name}={raw!r} is not {expected}") from exc
    if not math.isfinite(value):
        raise ValueError(f"{name}={raw!r} is not a finite number")
    if minimum is None and value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum:g}, got {raw!r}")
    return value


def write_stack_file(state_dir: Path, stack: dict) -> None:
    """Write stack.json readable by its owner only: the Redis URL in it may carry a
    password (``redis://user:password@host``), and whoever reaches Redis owns the stack."""
    # Whole or not at all: `iserve up` rewrites it as each process starts, and one
    # killed mid-write left it empty, its processes recorded nowhere (a probe).
    write_private(state_dir / STACK_FILE, json.dumps(stack, indent=2))


def _bare_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 address without the brackets a "host:port" needs."""
    return ":" in host and not (host.startswith("[") and host.endswith("]"))


def _address(variable: str, value: str | None) -> str | None:
    """``value`` (an ISERVE_*_ADDR) when it is ``host:port`` with a port from 0 to 65535
    (0: any free one); ValueError naming the variable otherwise (an out-of-range port
    used to wrap around to another, a word to fail later with a bare int() message)."""
    if not value:
        return value
    value = value.strip()
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"{variable}={value!r}: not host:port with a port from 0 to 65535 "
            "(e.g. 127.0.0.1:50051, 0.0.0.0:50051, [::1]:50051)"
        )
    if _bare_ipv6(host):
        # gRPC cannot bind or dial "::1:50051" ("misformatted domain name"), which a
        # Kubernetes manifest's $(POD_IP):port becomes on an IPv6 cluster.
        raise ValueError(f"{variable}={value!r}: an IPv6 address goes in brackets: [{host}]:{port}")
    return value


def _redis_url(url: str | None) -> str | None:
    """``url`` when redis-py (which connects with it) can parse it; ValueError naming
    REDIS_URL, its password hidden, otherwise (a bad scheme or port used to end in a
    traceback at the first connection)."""
    if not url:
        return None
    try:
        options = parse_url(url)
        parts = urlsplit(url)
        database = parts.path.strip("/")
        if parts.scheme in ("redis", "rediss") and database and "db" not in options:
            # redis-py ignores a path it cannot read as a number, and takes database 0:
            # on a shared Redis, maybe another stack's.
            raise ValueError(f"its path {database!r} is no database index (a number)")
        # A query option redis-py passes on that no connection takes ("?dbx=2") failed at
        # the first connection only; the connection class of the URL's scheme says so now.
        pool = ConnectionPool.from_url(url)
        pool.connection_class(**pool.connection_kwargs)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"REDIS_URL={redacted_url(url)!r}: {exc} "
            "(e.g. redis://:PASSWORD@HOST:6379/0, rediss://… with TLS, unix:///PATH)"
        ) from None
    return url


def redacted_url(url: str) -> str:
    """``url`` with its password, if any, shown as ``***`` (for logs and status): the
    one before the host and a ``password=`` option (which redis-py takes too)."""
    parts = urlsplit(url)
    options = parse_qsl(parts.query, keep_blank_values=True)
    if any(name.lower() == "password" for name, _ in options):
        query = [(n, "***" if n.lower() == "password" else v) for n, v in options]
        url = re.sub(r"\?.*$", "?" + urlencode(query, safe="*/:"), url, flags=re.S)
        parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number: hide whatever stands before the host
        return re.sub(r"//[^@/]*@", "//***@", url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    port = f":{port}" if port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


# What stack.json's fields hold (`iserve up` writes it whole, or not at all): the type of
# each field, and of the values of those that are maps of a name to a value.
_STACK_FIELDS: dict[str, tuple[type, Any]] = {
    "state_dir": (str, None),
    "stack_id": (str, None),
    "redis_url": (str, None),
    "embedded_redis": (bool, None),
    "gateway_address": (str, None),
    "models_root": (str, None),
    "started_at_unix_ms": (int, None),
    "pids": (dict, int),
    "started": (dict, (int, float, type(None))),
    "addresses": (dict, str),
    "metrics_addresses": (dict, str),
}


def read_stack_file(state_dir: Path) -> dict:
    """The stack description ``iserve up`` wrote, or ``{}`` when there is none. ValueError
    naming the file when it is not one (``iserve up`` writes it whole: this one is someone
    else's): every command crashed on a stack.json of ``null``, and `iserve down` said
    "no stack recorded" of an undecodable one, its processes left running (a probe)."""
    path = state_dir / STACK_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:  # the default ~/.iserve under a HOME that cannot hold it
        raise ValueError(
            f"state directory {state_dir} cannot be used ({path}: {exc.strerror}): set "
            "ISERVE_STATE_DIR to a writable directory"
        ) from None
    try:
        stack = json.loads(text)
        problem = _stack_problem(stack)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        problem = f"not JSON: {exc}"
    if problem:
        raise ValueError(
            f"{path} is not a stack record `iserve up` wrote ({problem}): if no stack runs "
            f"from {state_dir}, remove it; else stop its processes, then remove it"
        )
    return stack


def _of_type(value: Any, kind: Any) -> bool:
    """``isinstance``, but JSON's true and false are no numbers here."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _stack_problem(stack: Any) -> str | None:
    """What makes ``stack`` (stack.json's JSON) not a stack record, or None."""
    if not isinstance(stack, dict):
        return f"{json.dumps(stack)[:40]}, not an object"
    for name, (kind, values) in _STACK_FIELDS.items():
        if name not in stack:
            continue
        value = stack[name]
        if not _of_type(value, kind):
            return f"{name!r} is {json.dumps(value)[:40]}"
        if values is not None:
            wrong = [key for key, item in value.items() if not _of_type(item, values)]
            if wrong:
                return f"{name!r}[{wrong[0]!r}] is {json.dumps(value[wrong[0]])[:40]}"
    return None


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``env`` (default: ``os.environ``); raises ValueError on bad values."""
    env = os.environ if env is None else env
    state_dir = Path(env.get("ISERVE_STATE_DIR") or Path.home() / ".iserve").expanduser().resolve()
    models_root = Path(env.get("ISERVE_MODELS_ROOT") or state_dir / "models").expanduser().resolve()
    host = env.get("ISERVE_HOST", "127.0.0.1").strip()
    if _bare_ipv6(host):
        # A bare IPv6 address ($(POD_IP) on an IPv6 cluster): in brackets, so that the
        # "host:port" addresses made from it parse ("fd00::5:50061" binds nothing).
        host = f"[{host}]"
    stack = read_stack_file(state_dir)

    def pick(given: str | None, recorded: str | None, default: str) -> str:
        # The environment, else what `iserve up` recorded, else the default port.
        return given or recorded or default

    def resolve(
        variables: Mapping[str, str], recorded: Mapping[str, str], ports: Mapping[str, int]
    ):
        return {
            name: pick(
                _address(variables[name], env.get(variables[name])),
                recorded.get(name),
                f"{host}:{port}",
            )
            for name, port in ports.items()
        }

    addresses = resolve(SERVICE_ENV, stack.get("addresses", {}), DEFAULT_PORTS)
    metrics_addresses = resolve(
        METRICS_ENV, stack.get("metrics_addresses", {}), DEFAULT_METRICS_PORTS
    )
    return Settings(
        state_dir=state_dir,
        models_root=models_root,
        redis_url=_redis_url(env.get("REDIS_URL") or stack.get("redis_url")),
        host=host,
        addresses=addresses,
        metrics_addresses=metrics_addresses,
        node_id=node_id(env),
        virtual_devices=int(_number(env, "ISERVE_DEVICES", 2, maximum=MAX_VIRTUAL_DEVICES)),
        device_memory_bytes=int(_number(env, "ISERVE_DEVICE_MEMORY_GIB", 4.0, float) * GIB),
        queue_capacity=int(_number(env, "ISERVE_QUEUE_CAPACITY", 64)),
        ready_timeout_s=float(_number(env, "ISERVE_READY_TIMEOUT_S", 120.0, float)),
        heartbeat_ttl_s=float(_number(env, "ISERVE_HEARTBEAT_TTL_S", 5.0, float)),
        log_level=log_level(env),
        drain_timeout_s=drain_timeout_s(env),
        worker_pool=_flag(env, "ISERVE_WORKER_POOL", True),
        worker_ports=worker_ports(env.get(WORKER_PORTS_ENV, "")),
        max_restarts=int(
            _number(env, "ISERVE_MAX_RESTARTS", DEFAULT_MAX_RESTARTS, minimum=0, maximum=1000)
        ),
        restart_backoff_s=float(
            _number(env, "ISERVE_RESTART_BACKOFF_S", DEFAULT_RESTART_BACKOFF_S, float, maximum=3600)
        ),
        node_forget_after_s=float(
            _number(
                env,
                "ISERVE_NODE_FORGET_AFTER_S",
                DEFAULT_NODE_FORGET_AFTER_S,
                float,
                minimum=0,
                maximum=30 * 86400,
            )
        ),
        gateway_address=pick(
            _address(GATEWAY_ENV, env.get(GATEWAY_ENV)),
            stack.get("gateway_address"),
            f"{host}:{DEFAULT_GATEWAY_PORT}",  # ISERVE_HOST's, as every default address
        ),
        cors_origins=cors_origins(env.get(CORS_ENV, "")),
        auth=_flag(env, AUTH_ENV, False),
        token=_token(env, "ISERVE_TOKEN", state_dir, "admin"),
        service_token=_token(env, SERVICE_TOKEN_ENV, state_dir, "service"),
        admin_token=_token(env, ADMIN_TOKEN_ENV, state_dir, "admin"),
        tls=_tls(env),
        redis_port=int(_number(env, "ISERVE_REDIS_PORT", 0, minimum=0, maximum=65535)),
    )


# Every ISERVE_* variable an iserve process reads (the tables above); a unit test keeps
# it in step with the code.
KNOWN_VARIABLES = frozenset({
    *SERVICE_ENV.values(), *METRICS_ENV.values(), GATEWAY_ENV, CORS_ENV, STACK_ID_ENV,
    "ISERVE_STATE_DIR", "ISERVE_MODELS_ROOT", "ISERVE_HOST", "ISERVE_NODE_ID", "ISERVE_REDIS_PORT",
    "ISERVE_DEVICES", "ISERVE_DEVICE_MEMORY_GIB", "ISERVE_QUEUE_CAPACITY",
    "ISERVE_READY_TIMEOUT_S", "ISERVE_HEARTBEAT_TTL_S", "ISERVE_MAX_RESTARTS",
    "ISERVE_RESTART_BACKOFF_S", "ISERVE_NODE_FORGET_AFTER_S", "ISERVE_DRAIN_TIMEOUT_S",
    "ISERVE_LOG_LEVEL", "ISERVE_CPU_COLLECTIVES", "ISERVE_WORKER_POOL", "ISERVE_ENGINE",
    WORKER_PORTS_ENV,
    "ISERVE_AUTH", "ISERVE_TOKEN", "ISERVE_SERVICE_TOKEN", "ISERVE_ADMIN_TOKEN",
    "ISERVE_TLS_CERT", "ISERVE_TLS_KEY", "ISERVE_TLS_CA", "ISERVE_TLS_CLIENT_AUTH",
    "ISERVE_TLS_SERVER_NAME", "ISERVE_PROFILE_INPUT_TOKENS", "ISERVE_PROFILE_OUTPUT_TOKENS",
    "ISERVE_PROFILE_BATCH_SIZES", "ISERVE_PROFILE_WARMUP_RUNS", "ISERVE_PROFILE_TIMED_RUNS",
    # compose.yaml's (images, the models directory, the agent image's build) and the
    # tests' and benches' (../shared/data): set in the same shells, not misspelt.
    "ISERVE_IMAGE", "ISERVE_AGENT_IMAGE", "ISERVE_TAG", "ISERVE_MODELS_DIR",
    "ISERVE_TORCH_INDEX", "ISERVE_TENSORRT_LLM", "ISERVE_PYTHON_VERSION", "ISERVE_SHARED_DATA",
    "ISERVE_PUBLISH_ADDR", "ISERVE_PIP_EXTRA",
    # The Node.js client's (clients/node): another protos/ directory.
    "ISERVE_PROTOS",
})  # fmt: skip


def unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each ``ISERVE_*`` variable set that no iserve process reads, with the
    nearest known name (a misspelt name, ``_S`` left off, was ignored in silence, and
    the default used)."""
    env = os.environ if env is None else env
    # Matched on what follows the prefix, in upper case: the shared prefix made any name
    # "near" one (FOO near HOST), and a lower-case AUTH was offered TAG.
    known = {name.removeprefix("ISERVE_"): name for name in KNOWN_VARIABLES}
    warnings = []
    for name in sorted(n for n in env if n.upper().startswith("ISERVE_")):
        if name in KNOWN_VARIABLES:
            continue
        rest = name[len("ISERVE_") :].upper()
        near = known.get(rest) or next(
            iter(difflib.get_close_matches(rest, sorted(known), n=1, cutoff=0.75)), None
        )
        hint = f"; did you mean {known.get(near, near)}?" if near else ""
        if rest in known:
            hint += " (names are upper case)"
        warnings.append(f"{name} is set but no iserve process reads it{hint}")
    return warnings


def check_service_settings(env: Mapping[str, str] | None = None) -> None:
    """ValueError naming a bad variable that ``load_settings`` does not read: the
    agent's ``ISERVE_ENGINE`` and ``ISERVE_CPU_COLLECTIVES`` (read when it starts
    workers: at `iserve up` rather than at every deploy), and the model service's
    ``ISERVE_PROFILE_*`` (at `iserve up` rather than in its log once it failed)."""
    engine_choice(env)
    cpu_collectives(env)
    ProfilingSettings.from_env(env)


def node_id(env: Mapping[str, str]) -> str:
    """``ISERVE_NODE_ID`` (default node0); ValueError naming it when it is not a DNS
    name's characters (an empty id or one with ':' stopped the agent with a traceback)."""
    value = env.get("ISERVE_NODE_ID", "node0")
    if not NODE_ID_PATTERN.fullmatch(value):
        raise ValueError(f"ISERVE_NODE_ID must be {NODE_ID_RULE}, got {value!r}")
    return value


_ORIGIN = re.compile(
    r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?"
)


def cors_origins(raw: str) -> tuple[str, ...]:
    """``ISERVE_CORS_ORIGINS``: ``*`` or origins ``scheme://host[:port]`` (as a browser
    sends them: no path, no trailing slash), comma-separated; ValueError naming a bad one."""
    origins = tuple(o.strip() for o in raw.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ValueError(
                f"{CORS_ENV}: {origin!r} is not an origin; give '*' or "
                f"scheme://host[:port] such as http://localhost:3000 (no path)"
            )
    return origins


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """``env[name]`` as 1/0 (also true/false, yes/no, on/off); ValueError otherwise."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be on or off (also 1/0, true/false, yes/no), got {raw!r}")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(env: Mapping[str, str] | None = None) -> str:
    """``ISERVE_LOG_LEVEL``, upper-cased (default INFO); ValueError naming it for a level
    neither logging nor uvicorn knows (the gateway died of uvicorn's KeyError)."""
    env = os.environ if env is None else env
    level = env.get("ISERVE_LOG_LEVEL", "INFO").strip().upper() or "INFO"
    if level not in LOG_LEVELS:
        raise ValueError(f"ISERVE_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return level


def worker_ports(text: str) -> range | None:
    """``ISERVE_WORKER_PORTS`` (``LOW-HIGH``, inclusive, within 1024-65535) as a range;
    None when unset. ValueError naming the variable otherwise."""
    text = text.strip()
    if not text:
        return None
    low, sep, high = text.partition("-")
    try:
        if not sep:
            raise ValueError
        first, last = int(low), int(high)
    except ValueError:
        raise ValueError(
            f"{WORKER_PORTS_ENV} must be LOW-HIGH, two port numbers (e.g. 41000-41999), "
            f"got {text!r}"
        ) from None
    if not 1024 <= first <= last <= 65535:
        raise ValueError(
            f"{WORKER_PORTS_ENV} must be LOW-HIGH with 1024 <= LOW <= HIGH <= 65535, got {text!r}"
        )
    return range(first, last + 1)


def drain_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """``ISERVE_DRAIN_TIMEOUT_S`` in seconds (default 30); ValueError unless positive."""
    env = os.environ if env is None else env
    return float(_number(env, DRAIN_TIMEOUT_ENV, DEFAULT_DRAIN_TIMEOUT_S, float))


CPU_COLLECTIVES_ENV = "ISERVE_CPU_COLLECTIVES"


def cpu_collectives(env: Mapping[str, str] | None = None) -> str:
    """``ISERVE_CPU_COLLECTIVES``: "shm" (default) or "gloo"; ValueError otherwise."""
    env = os.environ if env is None else env
    choice = env.get(CPU_COLLECTIVES_ENV, "shm").strip().lower()
    if choice not in ("shm", "gloo"):
        raise ValueError(f"{CPU_COLLECTIVES_ENV} must be 'shm' or 'gloo', not {choice!r}")
    return choice


ENGINE_ENV = "ISERVE_ENGINE"
ENGINE_CHOICES = ("auto", "pytorch", "tensorrt_llm")


def engine_choice(env: Mapping[str, str] | None = None) -> str:
    """``ISERVE_ENGINE``: "auto" (default), "pytorch" or "tensorrt_llm"; ValueError otherwise."""
    env = os.environ if env is None else env
    choice = env.get(ENGINE_ENV, "auto").strip().lower() or "auto"
    if choice not in ENGINE_CHOICES:
        raise ValueError(f"{ENGINE_ENV} must be one of {ENGINE_CHOICES}, not {choice!r}")
    return choice


def _int_list(
    env: Mapping[str, str], name: str, default: tuple[int, ...], most: int | None = None
) -> tuple[int, ...]:
    """``env[name]``'s comma-separated integers (each at least 1, repeats dropped, at
    most ``most`` of them), ``default`` when unset; ValueError naming the variable."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        values = tuple(int(part) for part in raw.split(","))
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: give comma-separated integers") from exc
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name}={raw!r}: every value must be at least 1")
    values = tuple(dict.fromkeys(values))
    if most is not None and len(values) > most:
        raise ValueError(f"{name}: {len(values)} values; at most {most}")
    return values


# What one profiling job may ask for at most (RunProfilingJob, and so these settings):
# each length multiplies its runs, and each run holds the job's devices.
MAX_PROFILE_RUNS = 100
MAX_PROFILE_LENGTHS = 16
# ... and in all, decode steps over every run, prompt and output length (each bound alone
# still let a job of 200 runs x 17 prompts x 16 outputs of ~500 tokens ask for 27 million
# steps, weeks of a device; the defaults take 288).
MAX_PROFILE_DECODE_STEPS = 100_000


@dataclass(frozen=True)
class ProfilingSettings:
    # Three prompt lengths, so that estimates for other prompts follow prefill's measured
    # curve (weights linear in the prompt, attention quadratic: the parabola through
    # them, services.estimation.prompt_curve.profiles_at) instead of keeping
    # one length's figures. Ascending: one worker runs them in turn.
    input_tokens: tuple[int, ...] = (64, 256, 1024)
    output_tokens: tuple[int, ...] = (8, 16)
    batch_sizes: tuple[int, ...] = (1, 2)
    warmup_runs: int = 1
    timed_runs: int = 3

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProfilingSettings:
        """Settings from ``env`` (default: ``os.environ``); ValueError names a bad variable."""
        env = os.environ if env is None else env
        return cls(
            input_tokens=tuple(
                sorted(
                    _int_list(
                        env, "ISERVE_PROFILE_INPUT_TOKENS", cls.input_tokens, MAX_PROFILE_LENGTHS
                    )
                )
            ),
            output_tokens=_int_list(
                env, "ISERVE_PROFILE_OUTPUT_TOKENS", cls.output_tokens, MAX_PROFILE_LENGTHS
            ),
            batch_sizes=_int_list(env, "ISERVE_PROFILE_BATCH_SIZES", cls.batch_sizes),
            warmup_runs=int(
                _number(
                    env,
                    "ISERVE_PROFILE_WARMUP_RUNS",
                    cls.warmup_runs,
                    minimum=0,
                    maximum=MAX_PROFILE_RUNS,
                )
            ),
            timed_runs=int(
                _number(
                    env,
                    "ISERVE_PROFILE_TIMED_RUNS",
                    cls.timed_runs,
                    minimum=1,
                    maximum=MAX_PROFILE_RUNS,
                )
            ),
        )

    @property
    def max_seq_len(self) -> int:
        """Tokens of KV cache a profiling worker holds per sequence."""
        return max(self.input_tokens) + max(self.output_tokens)

    def fitted(self, max_positions: int) -> ProfilingSettings:
        """These lengths, shortened for a model whose context of ``max_positions``
        (0: unknown) cannot hold the longest prompt and output: the outputs get at most
        half the context, scaled down in proportion (distinct, at least 1 token), and
        each prompt what is left, at most its own length (distinct). ValueError below 2
        positions, which hold no prompt and output."""
        if not max_positions or self.max_seq_len <= max_positions:
            return self
        if max_positions < 2:
            raise ValueError(
                f"a context of {max_positions} position holds no prompt and output to profile"
            )
        longest = max(self.output_tokens)
        budget = min(longest, max_positions // 2)
        outputs = tuple(dict.fromkeys(max(1, o * budget // longest) for o in self.output_tokens))
        room = max_positions - max(outputs)
        prompts = tuple(sorted({min(n, room) for n in self.input_tokens}))
        return replace(self, input_tokens=prompts, output_tokens=outputs)
