"""The ``main`` every control-plane service shares: settings, logging, Redis, serve."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from services.grpc_server import Drain, ServiceBinding, configure_logging, run_server
from services.metrics import RpcMetrics, certificate_expiry, new_registry, serve_metrics
from services.security import metrics_guard, server_security
from services.settings import (
    METRICS_ENV,
    SERVICE_ENV,
    Settings,
    certificate_name_warnings,
    check_tls_identity,
    load_settings,
    redacted_url,
    tls_warnings,
    unknown_variables,
)
from services.state.store import (
    STATE_FORMAT,
    StateStore,
    StateStoreRefused,
    eviction_problem,
)

log = logging.getLogger("iserve.service")


@dataclass
class ServiceParts:
    """What a service contributes to its process."""

    bindings: list[ServiceBinding]
    background: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Runs once before the server listens (e.g. loading a cache it serves from).
    on_start: Callable[[], Awaitable[None]] | None = None
    on_stop: Callable[[], Awaitable[None]] | None = None
    # On SIGTERM, once the background tasks are cancelled and before the server stops
    # answering (run_server's before_stop).
    before_stop: Callable[[], Awaitable[None]] | None = None
    # On SIGTERM, awaited with ISERVE_DRAIN_TIMEOUT_S before the server stops (see
    # services.drain); None: calls in flight get run_server's short grace instead.
    drain: Drain | None = None
    # The service's Prometheus metrics (``services.metrics.new_registry`` plus its own);
    # None: a registry with the process collectors only. Either way the process adds
    # its RPC counter and serves it on ISERVE_<S>_METRICS_ADDR.
    registry: CollectorRegistry | None = None


# How long a starting service waits for Redis to answer (it may be starting beside it).
REDIS_WAIT_S = 10.0


def command_line(program: str, summary: str | None, args: list[str] | None = None) -> None:
    """The command line of a service's process, which takes no arguments: everything is
    set by environment variables. ``--help`` says so and exits; any argument is a usage
    error (status 2), not ignored while the service starts as if it were not given."""
    parser = argparse.ArgumentParser(
        prog=program,
        description=(summary or "").strip() or None,
        epilog="Takes no arguments: ISERVE_* variables and REDIS_URL configure it (the "
        "README's table; services/settings.py).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(args)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


async def connect_store(settings: Settings) -> StateStore:
    """A store connected to ``settings.redis_url``, retrying for REDIS_WAIT_S while Redis
    starts; exits with status 2 and the reason when there is none or it never answers."""
    if not settings.redis_url:
        fail(
            "REDIS_URL is not set (start the stack with `iserve up`, which writes "
            f"{settings.state_dir}/stack.json, or export REDIS_URL)"
        )
    store = StateStore.from_url(settings.redis_url)
    try:
        await store.wait_until_answering(REDIS_WAIT_S)
    except StateStoreRefused as exc:
        await store.close()
        fail(f"Redis at {redacted_url(settings.redis_url)}: {exc}")
    except Exception as exc:  # noqa: BLE001 - it never answered, for whatever reason
        await store.close()
        # Never the password: this lands in the service's log and terminal.
        fail(f"cannot reach Redis at {redacted_url(settings.redis_url)}: {exc}")
    problem, warning = eviction_problem(await store.eviction_policy())
    if problem:
        await store.close()
        fail(f"Redis at {redacted_url(settings.redis_url)}: {problem}")
    if warning:
        log.warning("Redis at %s: %s", redacted_url(settings.redis_url), warning)
    written = await store.claim_state_format()
    if written > STATE_FORMAT:
        await store.close()
        fail(
            f"Redis at {redacted_url(settings.redis_url)} holds records of format {written}, "
            f"written by a newer iserve; this one reads format {STATE_FORMAT} and older: "
            "run the newer iserve, or give this one another Redis (or database)"
        )
    return store


def serve_service(name: str, build: Callable[[Settings, StateStore], ServiceParts]) -> None:
    """Run service ``name`` (a key of ``settings.addresses``) until SIGTERM/SIGINT."""
    main = sys.modules.get("__main__")
    command_line(
        f"python -m {(getattr(main, '__package__', None) or name)}", main.__doc__ if main else None
    )
    try:
        settings = check_tls_identity(load_settings(), serving=True)
        if settings.auth:
            settings.require_service_token()
    except ValueError as exc:
        fail(str(exc))
    configure_logging(settings.log_level, name)
    own_address = {SERVICE_ENV[name]: settings.address(name)}
    for warning in [
        *unknown_variables(),
        *tls_warnings(settings),
        *certificate_name_warnings(settings, own_address),
    ]:
        log.warning("%s", warning)

    async def run() -> None:
        store = await connect_store(settings)
        try:
            security = await server_security(settings, store)
        except ValueError as exc:
            await store.close()
            fail(str(exc))
        parts = build(settings, store)
        if parts.on_start is not None:
            await parts.on_start()

        registry = parts.registry or new_registry()
        certificate_expiry(registry, settings.tls)
        rpc_metrics = RpcMetrics(registry)
        try:
            serve_metrics(
                settings.metrics_address(name),
                registry,
                guard=metrics_guard(security, asyncio.get_running_loop()),
                tls=settings.tls,
            )
        except OSError as exc:
            await store.close()
            fail(f"{exc} (set {METRICS_ENV[name]} to a free host:port)")

        async def stop() -> None:
            if parts.on_stop is not None:
                await parts.on_stop()
            await store.close()

        await run_server(
            name,
            parts.bindings,
            settings.address(name),
            background=parts.background,
            on_stop=stop,
            before_stop=parts.before_stop,
            drain=parts.drain,
            drain_timeout_s=settings.drain_timeout_s,
            metrics=rpc_metrics,
            security=security,
        )

    asyncio.run(run())
