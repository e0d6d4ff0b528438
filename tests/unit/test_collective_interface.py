"""Which interface a worker's collectives use (monitor_agent.engine.distributed): the one
of the address it serves on, asked of the kernel, unless the operator named one."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import pytest

from monitor_agent.engine.distributed import bind_collectives, interface_with_address


def _addresses() -> dict[str, str]:
    """IPv4 address -> interface, as iproute2 lists them (the test's own view)."""
    if shutil.which("ip") is None:
        return {}  # no iproute2 here: only the kernel's own answers are checked
    listed = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True)
    found = {}
    for line in listed.stdout.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] == "inet":
            found[fields[3].split("/")[0]] = fields[1]
    return found


def test_the_interface_of_an_address_is_the_kernel_s():
    assert interface_with_address("127.0.0.1") is not None  # loopback, whatever its name
    assert interface_with_address("203.0.113.254") is None  # nobody's here
    assert interface_with_address("not-an-address") is None
    for address, name in _addresses().items():
        if not address.startswith("127."):
            assert interface_with_address(address) == name


def test_a_node_s_address_binds_gloo_to_its_interface_unless_the_operator_named_one(monkeypatch):
    """Gloo bound where the host name resolves, 127.0.0.1 on most hosts: a rank on
    another node dialled that, and pipelines across nodes failed to start."""
    others = [a for a in _addresses() if not a.startswith("127.")]
    if not others:
        pytest.skip("no address but loopback here")
    # bind_collectives sets the variable itself: this process's environment is a copy,
    # so no worker a later test spawns inherits it (one did, and its gloo listened on
    # the network).
    monkeypatch.setattr(os, "environ", dict(os.environ))
    os.environ.pop("GLOO_SOCKET_IFNAME", None)
    assert bind_collectives(others[0], cuda=False) == _addresses()[others[0]]
    os.environ["GLOO_SOCKET_IFNAME"] = "chosen0"
    assert bind_collectives(others[0], cuda=False) is None
    del os.environ["GLOO_SOCKET_IFNAME"]
    for wildcard in ("0.0.0.0", "", socket.gethostname()):
        assert bind_collectives(wildcard, cuda=False) is None
        assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_a_group_on_this_host_binds_gloo_to_loopback(monkeypatch):
    """Every rank here, or a worker serving on loopback: gloo took the host name's
    address, the network's where it resolves to one, on a stack meant for loopback."""
    loopback = interface_with_address("127.0.0.1")
    for bind_host in ("127.0.0.1", "localhost", "0.0.0.0", ""):
        monkeypatch.setattr(os, "environ", {})
        assert bind_collectives(bind_host, cuda=False, local=True) == loopback
        assert os.environ == {"GLOO_SOCKET_IFNAME": loopback}
    # A group over hosts whose rank serves on loopback keeps gloo's own choice (the
    # agent warns of that setup; binding loopback made it fail for sure: a tester).
    monkeypatch.setattr(os, "environ", {})
    assert bind_collectives("127.0.0.1", cuda=False, local=False) is None
    assert bind_collectives("127.0.0.1", cuda=True, local=True) is None  # NCCL: its own


def test_a_host_name_that_resolves_to_loopback_is_told_apart():
    """An agent with ISERVE_HOST=0.0.0.0 advertises its workers by the host's name; where
    that resolves to loopback (most hosts' /etc/hosts) it now warns at start."""
    from monitor_agent.agent import _resolves_to_loopback

    assert _resolves_to_loopback("localhost") and _resolves_to_loopback("127.0.0.1")
    assert not _resolves_to_loopback("203.0.113.7")
    assert not _resolves_to_loopback("no-such-host.invalid")


@pytest.mark.parametrize(
    ("rendezvous_host", "bind_host", "listens_on"),
    [
        ("127.0.0.1", "0.0.0.0", "127.0.0.1"),  # every rank here: loopback, whatever else
        ("::1", "", "::1"),
        ("10.0.0.5", "10.0.0.5", "10.0.0.5"),  # a group over nodes: the serving address
        ("node0.cluster", "10.0.0.5", "10.0.0.5"),
        ("10.0.0.5", "0.0.0.0", "0.0.0.0"),  # the operator asked for every interface
        ("10.0.0.5", "", "0.0.0.0"),
        ("fd00::5", "::", "::"),
        ("node0.cluster", "::", "::"),  # IPv6's wildcard takes IPv4 too, not IPv4 only
        ("node0.cluster", "[::]", "::"),
    ],
)
def test_rank_0_s_store_listens_where_the_worker_serves(rendezvous_host, bind_host, listens_on):
    from monitor_agent.engine.distributed import store_listen_host

    assert store_listen_host(rendezvous_host, bind_host) == listens_on


def test_rank_0_s_store_listens_on_the_rendezvous_address_where_this_host_has_it():
    """A group over hosts whose rank 0 serves on loopback: the others dial the
    rendezvous's node address, which the store must listen on (a tester)."""
    from monitor_agent.engine.distributed import store_listen_host

    others = [a for a in _addresses() if not a.startswith("127.")]
    if not others:
        pytest.skip("no address but loopback here")
    assert store_listen_host(others[0], "127.0.0.1") == others[0]
    assert store_listen_host("203.0.113.254", "127.0.0.1") == "127.0.0.1"  # not ours


def test_a_failed_store_start_keeps_its_cause():
    """torch closes the descriptor it was handed when the store fails; closing it again
    replaced the cause (no peer came) with "Bad file descriptor" (a tester)."""
    from monitor_agent.engine.distributed import ParallelLayout, rendezvous_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(Exception) as failed:  # noqa: PT011 - torch's own error type
        rendezvous_store(f"127.0.0.1:{port}", ParallelLayout(2, 1, 0), 1.0, "127.0.0.1")
    assert not isinstance(failed.value, OSError) or failed.value.errno != 9, failed.value
    assert "Bad file descriptor" not in str(failed.value)


def test_a_store_port_in_use_is_named():
    from monitor_agent.engine.distributed import ParallelLayout, rendezvous_store

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            RuntimeError, match=f"rank 0 cannot listen for its group on 127.0.0.1:{port}"
        ):
            rendezvous_store(f"127.0.0.1:{port}", ParallelLayout(1, 2, 0), 5.0, "127.0.0.1")
