"""Free ports for child servers (services/ports.py): drawn outside the kernel's ephemeral
range, so an outgoing connection opened before the child binds cannot hold one."""

from __future__ import annotations

import socket

import pytest

from services import ports


def test_the_kernel_range_is_read_and_a_bad_file_is_unknown(tmp_path) -> None:
    good = tmp_path / "range"
    good.write_text("32768\t60999\n")
    assert ports.ephemeral_range(good) == range(32768, 61000)
    for text in ("", "nonsense", "60999 32768", "1 70000"):
        good.write_text(text)
        assert ports.ephemeral_range(good) is None
    assert ports.ephemeral_range(tmp_path / "missing") is None


def test_the_drawn_ranges_avoid_the_ephemeral_range_and_the_customary_ports() -> None:
    parts = ports.drawable_ports(range(32768, 61000))
    assert parts == [range(10000, 32768), range(61000, 65536)]
    # A range that starts low leaves only what lies above it.
    assert ports.drawable_ports(range(1024, 65536)) == []
    assert ports.drawable_ports(range(1024, 50000)) == [range(50000, 65536)]
    assert ports.drawable_ports(None) == []


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    ephemeral = ports.ephemeral_range()
    drawn = [ports.free_port() for _ in range(50)]
    assert len(set(drawn)) == len(drawn)
    for port in drawn:
        assert ports.bindable("127.0.0.1", port)
        if ephemeral is not None:
            assert port not in ephemeral
            assert port >= ports.LOWEST_DRAWN_PORT


def test_a_port_a_server_holds_is_never_drawn(monkeypatch) -> None:
    with socket.socket() as server, socket.socket() as probe:
        server.bind(("127.0.0.1", 0))
        server.listen()
        held = server.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()
        assert not ports.bindable("127.0.0.1", held)
        monkeypatch.setattr(
            ports, "drawable_ports", lambda _eph: [range(held, held + 1), range(free, free + 1)]
        )
        assert ports.free_port() == free


def test_without_a_known_range_the_kernel_chooses(monkeypatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: None)
    port = ports.free_port()
    assert ports.bindable("127.0.0.1", port)


def test_when_every_draw_is_taken_the_kernel_chooses(monkeypatch) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        held = server.getsockname()[1]
        monkeypatch.setattr(ports, "drawable_ports", lambda _eph: [range(held, held + 1)])
        port = ports.free_port()
    assert port != held


def test_bindable_tells_a_listening_port_from_a_closed_one() -> None:
    host = "127.0.0.1"
    with socket.socket() as server:
        server.bind((host, 0))
        server.listen()
        port = server.getsockname()[1]
        assert not ports.bindable(host, port)
    assert ports.bindable(host, port)


def test_up_never_chooses_a_port_the_configuration_names(monkeypatch, tmp_path) -> None:
    """`iserve up` with the scheduler at a given port and other servers at "host:0": that
    port is bound only later, by the scheduler, so neither a chosen port nor the embedded
    Redis's may be it (the scheduler could not bind it then, and `up` failed)."""
    from services.cli.stack import with_chosen_ports
    from services.settings import GATEWAY_ENV, METRICS_ENV, SERVICE_ENV, load_settings

    named = ports.free_port()
    env = {
        "ISERVE_STATE_DIR": str(tmp_path),
        **{var: "127.0.0.1:0" for var in (*SERVICE_ENV.values(), *METRICS_ENV.values())},
        SERVICE_ENV["scheduler"]: f"127.0.0.1:{named}",
        GATEWAY_ENV: "127.0.0.1:0",
    }
    monkeypatch.setattr(ports, "_issued", set())  # as in a fresh `up` process
    # Every draw offers the named port first, as an unlucky draw would.
    monkeypatch.setattr(ports, "drawable_ports", lambda _eph: [range(named, named + 1)])
    settings = with_chosen_ports(load_settings(env))
    chosen = [
        *settings.addresses.values(),
        *settings.metrics_addresses.values(),
        settings.gateway_address,
    ]
    assert settings.address("scheduler") == f"127.0.0.1:{named}"
    assert sum(a.endswith(f":{named}") for a in chosen) == 1, chosen
    assert ports.free_port() != named  # the embedded Redis's, drawn after


def test_a_port_of_a_configured_range_is_free_not_taken_and_may_come_back() -> None:
    """ISERVE_WORKER_PORTS: a free port of the range, never one handed out and not yet
    given back, and again once it is (free_port's never-again would run a range dry)."""
    from services.ports import free_port_in

    low = ports.free_port()
    span = range(low, low + 1)
    assert ports.free_port_in(span, "127.0.0.1") == low
    assert free_port_in(span, "127.0.0.1") == low  # handed out again: it is free
    with pytest.raises(OSError, match=rf"no free port in {low}-{low} on 127.0.0.1"):
        free_port_in(span, "127.0.0.1", taken={low})
    with socket.socket() as held:
        held.bind(("127.0.0.1", low))
        held.listen()
        with pytest.raises(OSError, match="every one is in use"):
            free_port_in(span, "127.0.0.1")


def test_an_ipv6_host_is_bound_in_its_own_family() -> None:
    """ISERVE_HOST=[::1] (or ::1): every port read as taken, bound in IPv4's family."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = ports.free_port_in(range(ports.free_port(), 65536), "[::1]")
    assert ports.bindable("::1", port) and ports.bindable("[::1]", port)
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::1", port))
        held.listen()
        assert not ports.bindable("[::1]", port)
    assert ports.free_port("::1") > 0
