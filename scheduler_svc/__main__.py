"""``python -m scheduler_svc``: serve InferenceService until SIGTERM/SIGINT.

Reads the usual settings (``services.settings``); needs Redis (``REDIS_URL`` or the
``stack.json`` written by ``iserve up``) and exits with status 2 when it has none.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from scheduler_svc.servicer import InferenceServicer
from services.grpc_server import configure_logging, run_server
from services.settings import Settings, load_settings
from services.state.store import StateStore

log = logging.getLogger("iserve.scheduler")

REDIS_WAIT_S = 10.0


async def serve(settings: Settings) -> int:
    store = StateStore.from_url(settings.redis_url)
    try:
        if not await _wait_for_redis(store, settings.redis_url):
            return 2
        servicer = InferenceServicer(store, settings.queue_capacity)
        try:
            await servicer.router.refresh()
            await run_server(
                "scheduler",
                [servicer.binding()],
                settings.address("scheduler"),
                background=[servicer.refresh_forever],
            )
        finally:
            await servicer.close()
    finally:
        await store.close()
    return 0


async def _wait_for_redis(store: StateStore, url: str) -> bool:
    """True once Redis answers; False (logged) when it does not within REDIS_WAIT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + REDIS_WAIT_S
    while True:
        try:
            return await store.ping()
        except Exception as exc:  # noqa: BLE001 - any failure means "not reachable yet"
            if loop.time() >= deadline:
                log.error("Redis at %s does not answer: %s", url, exc)
                return False
        await asyncio.sleep(0.5)


def main() -> int:
    try:
        settings = load_settings()
    except ValueError as exc:
        print(f"scheduler: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, "scheduler")
    if not settings.redis_url:
        print(
            "scheduler: no Redis configured: set REDIS_URL (e.g. redis://127.0.0.1:6379/0) "
            f"or start the stack with `iserve up` (which writes {settings.state_dir}/stack.json)",
            file=sys.stderr,
        )
        return 2
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
