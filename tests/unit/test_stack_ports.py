"""``iserve up``'s check that its ports are free (services/cli/stack.py)."""

from __future__ import annotations

import socket

from services.cli.stack import port_in_use


def test_a_listening_port_is_in_use_and_a_closed_one_is_free() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert port_in_use(address)
    assert not port_in_use(address)


def test_probing_opens_no_connection(monkeypatch) -> None:
    """A connect probe of an unused port in the ephemeral range can connect to itself (TCP
    simultaneous open), reporting the port busy and holding it in TIME_WAIT; the probe
    binds instead."""

    def no_connect(self, address):
        raise AssertionError(f"the port probe connected to {address}")

    monkeypatch.setattr(socket.socket, "connect", no_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", no_connect)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert not port_in_use(f"127.0.0.1:{port}")
