"""The log of refused authentication: one line per client host and reason per interval,
the refusals between counted into the next line, and no more keys than MAX_KEYS."""

from __future__ import annotations

import logging

import pytest

from services.auth import refusals
from services.auth.refusals import RefusalLog, client_host


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:127.0.0.1:51234", "127.0.0.1"),
        ("ipv6:[::1]:51234", "::1"),
        ("ipv6:[2001:db8::7]:8", "2001:db8::7"),
        ("unix:/tmp/socket", "unix:/tmp/socket"),
        ("", "unknown"),
    ],
)
def test_a_peer_is_its_host_without_the_port(peer, host):
    assert client_host(peer) == host


def test_a_retrying_client_is_one_line_per_interval_with_a_count(caplog):
    clock = Clock()
    log = RefusalLog(logging.getLogger("test.refusals"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(5):
            log.refused("10.0.0.9", "invalid or revoked token", "/iserve.v1.X/Y")
        log.refused("10.0.0.8", "invalid or revoked token", "/iserve.v1.X/Y")
        log.refused("10.0.0.9", "no bearer token", "/iserve.v1.X/Y")
        log.refused("10.0.0.9", "invalid or revoked token", "/iserve.v1.X/Z")
        clock.now = 10.5
        log.refused("10.0.0.9", "invalid or revoked token", "/iserve.v1.X/Y")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused /iserve.v1.X/Y from 10.0.0.9: invalid or revoked token",
        "refused /iserve.v1.X/Y from 10.0.0.8: invalid or revoked token",
        "refused /iserve.v1.X/Y from 10.0.0.9: no bearer token",
        "refused /iserve.v1.X/Z from 10.0.0.9: invalid or revoked token",
        "refused /iserve.v1.X/Y from 10.0.0.9: invalid or revoked token "
        "(4 more like it since the last line)",
    ]


def test_it_remembers_a_bounded_number_of_clients(monkeypatch):
    monkeypatch.setattr(refusals, "MAX_KEYS", 3)
    log = RefusalLog(logging.getLogger("test.refusals.bounded"), clock=Clock())
    for i in range(10):
        log.refused(f"10.0.0.{i}", "no bearer token", "GET /v1/models")
    assert len(log._seen) == 3
