"""A Redis that answers but refuses: what a process starting on it says, and how the
store names it (a real redis-server of this module's own, reconfigured per test)."""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import pytest
import redis

from services.api import model_service_pb2 as model_pb
from services.service_main import connect_store
from services.settings import load_settings
from services.state.store import StateStore, StateStoreRefused, eviction_problem


def _connect(tmp_path, url: str) -> None:
    """What a starting service does with REDIS_URL=``url``: connect_store, then close."""
    settings = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "REDIS_URL": url})

    async def main() -> None:
        await (await connect_store(settings)).close()

    asyncio.run(main())


@pytest.fixture
def admin(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 0)
    client.acl_deluser("limited")
    client.config_set("requirepass", urlsplit(redis_url).password or "")
    client.close()


def test_a_redis_that_would_evict_iserve_s_records_is_refused_at_start(
    tmp_path, redis_url, admin, capsys, caplog
):
    """allkeys-lru deleted models, deployments and reservations once full (a device's
    reserved memory never came back); it was taken without a word."""
    admin.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(SystemExit) as stopped:
        _connect(tmp_path, redis_url)
    assert stopped.value.code == 2
    assert "maxmemory-policy is allkeys-lru" in capsys.readouterr().err
    admin.config_set("maxmemory-policy", "volatile-lru")
    with caplog.at_level(logging.WARNING):
        _connect(tmp_path, redis_url)
    assert "agents' heartbeats" in caplog.text
    assert eviction_problem("noeviction") == ("", "") and eviction_problem(None) == ("", "")


@pytest.mark.parametrize("how", ["password changed", "wrong password", "no such database"])
def test_a_refusal_no_retry_changes_stops_a_starting_process_at_once(
    tmp_path, redis_url, admin, capsys, how
):
    """Each was retried for 10 s and reported as "unreachable"."""
    parts = urlsplit(redis_url)
    url = redis_url
    if how != "no such database":
        admin.config_set("requirepass", "right-password")
        if how == "wrong password":
            url = f"redis://:wrong-password@{parts.hostname}:{parts.port}/0"
    else:
        url = f"redis://{parts.hostname}:{parts.port}/99"
    started = time.monotonic()
    with pytest.raises(SystemExit):
        _connect(tmp_path, url)
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert "refuses iserve's commands" in err and "unreachable" not in err, err
    assert "wrong-password" not in err


def test_commands_redis_refuses_are_named_with_what_to_do(redis_url, admin):
    admin.acl_setuser(
        "limited",
        enabled=True,
        passwords=["+limited-pw"],
        keys=["*"],
        commands=["+ping", "+get", "+info"],
    )
    parts = urlsplit(redis_url)

    async def refused(url: str) -> str:
        store = StateStore.from_url(url)
        try:
            with pytest.raises(StateStoreRefused) as raised:
                await store.create_model(model_pb.Model(model_id="m"))
            return str(raised.value)
        finally:
            await store.close()

    limited = f"redis://limited:limited-pw@{parts.hostname}:{parts.port}/0"
    assert "lacks a permission iserve needs" in asyncio.run(refused(limited))
    admin.config_set("maxmemory", 1)
    assert "full (maxmemory)" in asyncio.run(refused(redis_url))


def test_a_redis_written_by_a_newer_iserve_is_refused_at_start(tmp_path, redis_url, admin, capsys):
    """An older iserve on a newer one's records failed each call on a record it could
    not parse (a bare INTERNAL ParseError) and could not write over it either."""
    from services.state import keys
    from services.state.store import STATE_FORMAT

    admin.delete(keys.state_format())
    _connect(tmp_path, redis_url)
    assert int(admin.get(keys.state_format())) == STATE_FORMAT  # claimed by this one
    admin.set(keys.state_format(), STATE_FORMAT + 1)
    with pytest.raises(SystemExit):
        _connect(tmp_path, redis_url)
    assert (
        f"records of format {STATE_FORMAT + 1}, written by a newer iserve"
        in capsys.readouterr().err
    )
    admin.delete(keys.state_format())


def test_more_concurrent_calls_than_the_pool_holds_wait_for_a_connection(run):
    # A probe: 400 concurrent ListDeployments got "Redis unreachable: Too many
    # connections" from redis-py's default pool (100, failing at once).
    from services.state.store import POOL_CONNECTIONS

    async def calls(store: StateStore) -> list:
        # Each read holds its connection for its 0.3 s block.
        return await asyncio.gather(
            *(store.read_events(block_ms=300) for _ in range(POOL_CONNECTIONS + 40)),
            return_exceptions=True,
        )

    results = run(calls)
    assert [r for r in results if isinstance(r, BaseException)] == []


@pytest.mark.parametrize("password", ["", ":wrong-password@"])
def test_a_unix_socket_redis_that_wants_another_password_is_refused_at_once(
    tmp_path, capsys, password
):
    """Over a unix socket redis-py's asyncio client raises a wrong or missing password as a
    plain ConnectionError: it was retried for 12 s and reported as "unreachable"."""
    import subprocess

    from services.redis_embedded import find_redis_server

    socket_path = tmp_path / "redis.sock"
    server = subprocess.Popen(
        [find_redis_server(), "--port", "0", "--unixsocket", str(socket_path),
         "--requirepass", "right-password", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        url = f"unix://{password}{socket_path}"
        started = time.monotonic()
        with pytest.raises(SystemExit):
            _connect(tmp_path / "state", url)
        assert time.monotonic() - started < 5
        err = capsys.readouterr().err
        assert "refuses iserve's commands (check the user and password in REDIS_URL)" in err, err
        assert "unreachable" not in err and "wrong-password" not in err
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_redis_that_cannot_save_is_a_refusal_saying_to_free_its_disk():
    """A full disk under Redis (MISCONF) came back INTERNAL, with a traceback (a tester):
    a refusal, UNAVAILABLE like the others, with what to do."""
    from redis.exceptions import ResponseError

    from services.state.store import _refusal_hint, _refused

    full = ResponseError("MISCONF Errors writing to the AOF file: No space left on device")
    assert _refused(full)
    assert "free its disk" in _refusal_hint(full)
    assert not _refused(ResponseError("WRONGTYPE Operation against a key"))
