"""``iserve up``'s check that its ports are free (services/cli/stack.py)."""

from __future__ import annotations

import socket

import pytest

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


def test_up_names_busy_ports_and_why_one_in_the_ephemeral_range_may_be(tmp_path, monkeypatch):
    """A port in the range outgoing connections draw from may be held by another
    program's connection for a while: `up` says so, where before it only said "in use"."""
    from services.cli import stack
    from services.cli.stack import UpOptions
    from services.ports import ephemeral_range
    from services.settings import GATEWAY_ENV, METRICS_ENV, SERVICE_ENV, load_settings

    ephemeral = ephemeral_range()
    if ephemeral is None:
        pytest.skip("no Linux ephemeral port range here")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))  # the kernel draws from the ephemeral range
        server.listen()
        port = server.getsockname()[1]
        assert port in ephemeral
        monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
        for variable in (*SERVICE_ENV.values(), *METRICS_ENV.values(), GATEWAY_ENV):
            monkeypatch.setenv(variable, "127.0.0.1:0")  # only the one below is busy
        monkeypatch.setenv("ISERVE_ESTIMATOR_ADDR", f"127.0.0.1:{port}")
        with pytest.raises(RuntimeError) as refused:
            stack.up(load_settings(), UpOptions(), log=lambda _m: None)
    message = str(refused.value)
    assert f"port(s) already in use: estimator 127.0.0.1:{port}" in message
    assert f"{ephemeral.start}-{ephemeral.stop - 1}" in message and "retrying" in message
    assert not (tmp_path / "stack.json").exists()
