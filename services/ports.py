"""Free TCP ports for servers this process is about to start in another process.

A port found free is handed to a child (a service, redis-server, a worker's rendezvous)
that binds it a moment later. Any outgoing connection opened meanwhile, by anyone on the
machine, takes its source port from the kernel's ephemeral range, so a port drawn from
that range (what binding port 0 returns) can be a connection's by the time the child
binds it. ``free_port`` therefore draws outside that range, as the default service and
metrics ports do, and never hands out the same port twice in one process, nor a port
``reserve`` was told of (one the configuration names for a server that starts later).
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterable
from pathlib import Path

# Linux's range for connections' source ports; elsewhere the range is not read and the
# kernel's own choice (port 0) is the fallback.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Below this lie the customary ports of other software (databases, web servers, 8000).
LOWEST_DRAWN_PORT = 10000
HIGHEST_PORT = 65535
_DRAWS = 200

_issued: set[int] = set()
_lock = threading.Lock()


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> range | None:
    """The kernel's source-port range for outgoing connections, or None where unknown."""
    try:
        low, high = (int(value) for value in path.read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1) if 0 < low <= high <= HIGHEST_PORT else None


def drawable_ports(ephemeral: range | None) -> list[range]:
    """The port ranges ``free_port`` draws from: above LOWEST_DRAWN_PORT and outside
    ``ephemeral``; empty when the ephemeral range is unknown."""
    if ephemeral is None:
        return []
    below = range(LOWEST_DRAWN_PORT, max(LOWEST_DRAWN_PORT, ephemeral.start))
    above = range(max(LOWEST_DRAWN_PORT, ephemeral.stop), HIGHEST_PORT + 1)
    return [part for part in (below, above) if len(part)]


def bindable(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (SO_REUSEADDR, as gRPC and Redis
    bind: a closed connection's TIME_WAIT does not count). Binds, never connects: a
    connect to an unused ephemeral port can pick that port as its own source."""
    host, family = _host_and_family(host)
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listening_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``host:port`` (an IPv4 or bracketed or bare IPv6 address,
    or a name), SO_REUSEADDR as servers bind; OSError when it cannot."""
    host, family = _host_and_family(host)
    sock = socket.socket(family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _host_and_family(host: str) -> tuple[str, socket.AddressFamily]:
    """``host`` without the brackets an address writes around IPv6 (``[::1]``), and the
    socket family it binds in: an IPv6 host was never bindable in IPv4's."""
    host = host.strip("[]")
    return host, socket.AF_INET6 if ":" in host else socket.AF_INET


def _kernel_choice(host: str) -> int:
    host, family = _host_and_family(host)
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def reserve(ports: Iterable[int]) -> None:
    """Never hand out ``ports``: they are named for servers not bound yet (an address the
    operator set), so ``bindable`` cannot see that they are taken."""
    with _lock:
        _issued.update(port for port in ports if port)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the ephemeral range where the kernel says
    what that is, and not handed out before by this process."""
    parts = drawable_ports(ephemeral_range())
    sizes = [len(part) for part in parts]
    with _lock:
        for _ in range(_DRAWS if parts else 0):
            part = random.choices(parts, weights=sizes)[0]
            port = random.choice(part)
            if port not in _issued and bindable(host, port):
                _issued.add(port)
                return port
        for _ in range(_DRAWS):
            port = _kernel_choice(host)
            if port not in _issued:
                _issued.add(port)
                return port
    raise OSError(f"no free port on {host}")


def free_port_in(ports: range, host: str, taken: Iterable[int] = ()) -> int:
    """A port of ``ports`` free on ``host`` now and not in ``taken`` (those handed to
    processes that may not have bound them yet), tried in random order. Unlike
    :func:`free_port` it may hand out a port again once it is free: a configured range
    (``ISERVE_WORKER_PORTS``) would run out over an agent's life otherwise. OSError
    naming the range when none is free."""
    taken = set(taken)
    with _lock:
        for port in random.sample(ports, len(ports)):
            if port not in taken and bindable(host, port):
                return port
    raise OSError(
        f"no free port in {ports.start}-{ports.stop - 1} on {host} (ISERVE_WORKER_PORTS): "
        "every one is in use"
    )
