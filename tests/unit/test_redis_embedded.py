"""The embedded Redis of ``iserve up`` asks for a password that no other local user can
read: not on its command line, in files of mode 0600, the same across restarts."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import redis

from services.redis_embedded import CONFIG_FILE, PASSWORD_FILE, start_redis


def stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def test_the_embedded_redis_asks_for_a_password_kept_from_others(tmp_path):
    data = tmp_path / "redis"
    data.mkdir(mode=0o755)  # as an older iserve made it
    data.chmod(0o755)
    proc, url = start_redis(data, appendonly=False)
    # Its data (the append-only file: every record) is the owner's alone.
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    try:
        password = (data / PASSWORD_FILE).read_text().strip()
        assert f":{password}@" in url
        client = redis.Redis.from_url(url)
        assert client.ping()
        port = client.connection_pool.connection_kwargs["port"]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port).ping()
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        for name in (PASSWORD_FILE, CONFIG_FILE):
            assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
        client.set("kept", "yes")
        client.close()
    finally:
        stop(proc)
    again, url_again = start_redis(data, appendonly=False)  # as iserve up after down
    try:
        assert url_again.split("@")[0] == url.split("@")[0]  # the same password
        assert redis.Redis.from_url(url_again).ping()
    finally:
        stop(again)


def test_the_embedded_redis_listens_on_its_last_port_while_that_is_free(tmp_path):
    """Drawn anew at each `iserve up`, the port changed across a stack restart: agents of
    other nodes, given the old URL, were cut off for good."""
    import socket

    data = tmp_path / "redis"
    proc, url = start_redis(data, appendonly=False)
    stop(proc)
    again, url_again = start_redis(data, appendonly=False)
    try:
        assert url_again == url
    finally:
        stop(again)
    port = int(url.rpartition(":")[2].split("/")[0])
    with socket.socket() as holder:  # another program took it meanwhile: another port
        holder.bind(("127.0.0.1", port))
        holder.listen()
        moved, url_moved = start_redis(data, appendonly=False)
        try:
            assert url_moved != url and redis.Redis.from_url(url_moved).ping()
        finally:
            stop(moved)


def test_an_empty_password_file_is_made_again(tmp_path):
    """A first start cut off by a full disk left an empty password file, and every start
    after failed on Redis's "requirepass" with no argument; it is now made again (and
    written whole or not at all). One that holds what a config cannot is refused naming
    the file."""
    data = tmp_path / "redis"
    data.mkdir()
    (data / PASSWORD_FILE).write_text("")
    proc, url = start_redis(data, appendonly=False)
    try:
        password = (data / PASSWORD_FILE).read_text().strip()
        assert password and f":{password}@" in url
        assert redis.Redis.from_url(url).ping()
        assert stat.S_IMODE((data / PASSWORD_FILE).stat().st_mode) == 0o600
        assert not list(data.glob("*.partial"))
    finally:
        stop(proc)
    (data / PASSWORD_FILE).write_text("two words\n")
    with pytest.raises(RuntimeError, match=r"redis/password holds no usable Redis password"):
        start_redis(data, appendonly=False)
