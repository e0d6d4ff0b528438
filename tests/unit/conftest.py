"""Fixtures shared by unit tests: a real redis-server, and a tiny checkpoint."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from services.models.checkpoint import create_checkpoint
from services.redis_embedded import start_redis
from services.state.store import StateStore

T = TypeVar("T")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """A redis-server for one test module, stopped after it."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"), appendonly=False)
    yield url
    proc.terminate()
    proc.wait(10)
    if proc.stderr is not None:
        proc.stderr.close()


@pytest.fixture
def run(redis_url) -> Callable[[Callable[[StateStore], Awaitable[T]]], T]:
    """Run ``fn(store)`` on a fresh store over a flushed database; returns its result."""

    def runner(fn: Callable[[StateStore], Awaitable[T]]) -> T:
        async def main() -> T:
            store = StateStore.from_url(redis_url)
            await store.redis.flushdb()
            await store.claim_state_format()  # as every service does at start
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(main())

    return runner


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A 2-layer Llama checkpoint (hidden 64, 4 heads, 2 KV heads) for one test module;
    a module that needs another shape defines its own ``checkpoint``."""
    return create_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
