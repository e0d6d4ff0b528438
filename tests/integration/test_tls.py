"""TLS on real processes: every gRPC server listens with the stack's certificate and
requires a client certificate (mutual TLS), every client — the CLI, the services
calling each other, the scheduler streaming from workers — connects with it, and
plaintext or uncertified clients are turned away."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import transport
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import deployment_service_pb2_grpc, model_service_pb2_grpc
from services.api import model_service_pb2 as model_pb
from services.cli import stack as launcher
from services.models.checkpoint import create_checkpoint
from services.settings import Settings, token_file
from tests.integration.helpers import TINY, rid, run_cli
from tests.pki import make_pki

MODEL = "tls-llama"


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory) -> Iterator[tuple[Settings, dict[str, Path], Path]]:
    root = tmp_path_factory.mktemp("iserve-tls")
    pki = make_pki(root / "pki")
    env = {
        "ISERVE_AUTH": "on",
        "ISERVE_TLS_CERT": str(pki["cert"]),
        "ISERVE_TLS_KEY": str(pki["key"]),
        "ISERVE_TLS_CA": str(pki["ca"]),
        "ISERVE_TLS_CLIENT_AUTH": "on",
        "ISERVE_DEVICES": "2",
        "ISERVE_DEVICE_MEMORY_GIB": "2",
        "ISERVE_READY_TIMEOUT_S": "90",
    }
    with launcher.temporary_stack(env, state_dir=root / "state") as settings:
        yield settings, pki, root


def _serving(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def tls_deployed(tls_stack) -> deploy_pb.Deployment:
    """The model registered and deployed over TLS by this process (the environment's
    transport: TLS with the certificate, the stack's admin token)."""
    settings, _pki, _root = tls_stack
    create_checkpoint(settings.models_root / MODEL, **TINY, overwrite=True)
    own = transport.current()
    assert own.tls is not None and own.tls.client_auth
    with own.sync_channel(settings.address("model")) as ch:
        model_service_pb2_grpc.ModelServiceStub(ch).RegisterModel(
            model_pb.RegisterModelRequest(
                model_id=MODEL, checkpoint_path=MODEL, skip_profiling=True
            )
        )
    with own.sync_channel(settings.address("deploy")) as ch:
        return (
            deployment_service_pb2_grpc.DeploymentServiceStub(ch)
            .Deploy(
                deploy_pb.DeployRequest(
                    request_id=rid(),
                    model_id=MODEL,
                    config=common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1),
                ),
                timeout=180,
            )
            .deployment
        )


def test_services_and_workers_talk_over_mutual_tls(tls_stack, tls_deployed):
    settings, pki, root = tls_stack
    deployment = tls_deployed
    own = transport.current()
    # The CLI, in its own process, streams through the scheduler from the worker: three
    # TLS hops (CLI -> scheduler -> worker), the deploy having used deployer -> agent.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "generate",
            MODEL,
            "hello",
            "--max-tokens",
            "5",
        ],
        env={**os.environ},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "[5 tokens, length; " in out.stderr and deployment.deployment_id in out.stderr, out

    # Every server, the worker too, turns away plaintext and uncertified clients.
    addresses = [*settings.addresses.values(), deployment.worker_address]
    other_ca = make_pki(root / "other", "another CA")
    for address in addresses:
        assert _serving(own.sync_channel(address)) == grpc.StatusCode.OK, address
        assert _serving(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE, address
        no_cert = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
        assert _serving(grpc.secure_channel(address, no_cert)) == grpc.StatusCode.UNAVAILABLE
        foreign = grpc.ssl_channel_credentials(
            root_certificates=pki["ca"].read_bytes(),
            private_key=other_ca["key"].read_bytes(),
            certificate_chain=other_ca["cert"].read_bytes(),
        )
        assert _serving(grpc.secure_channel(address, foreign)) == grpc.StatusCode.UNAVAILABLE


def test_metrics_are_served_over_https_to_admin_tokens(tls_stack):
    settings, pki, root = tls_stack
    admin = token_file(settings.state_dir, "admin").read_text().strip()
    url = f"https://{settings.metrics_address('deploy')}/metrics"
    scraped = scrape(url, admin, client_tls(pki))
    assert b"iserve_grpc_server_handled_total" in scraped
    # When the certificate it presents expires, for an alert to fire before that: the
    # gRPC services and the gateway (under mutual TLS it presents one to the services).
    expires = x509.load_pem_x509_certificate(pki["cert"].read_bytes()).not_valid_after_utc
    gateway = urllib.request.urlopen(f"http://{settings.gateway_address}/metrics", timeout=10)
    for text in (scraped, gateway.read()):
        assert _gauge(text) == expires.timestamp(), text[-2000:]
    # Mutual TLS holds here as on the gRPC ports: no certificate, or one another CA
    # signed, is turned away before the token is read.
    stranger = make_pki(root / "stranger-pki", ca_name="another CA")
    for context in (client_tls(pki, certificate=False), client_tls(pki, presents=stranger)):
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            scrape(url, admin, context)


def _gauge(text: bytes) -> float | None:
    """The value of iserve_tls_certificate_expiry_timestamp_seconds in Prometheus text."""
    for line in text.decode().splitlines():
        if line.startswith("iserve_tls_certificate_expiry_timestamp_seconds "):
            return float(line.split()[1])
    return None


def test_a_silent_connection_does_not_hold_up_the_scrapes(tls_stack):
    """The TLS handshake runs in the connection's own thread: a client that connects and
    never sends used to block every other scrape of that port."""
    settings, pki, _root = tls_stack
    admin = token_file(settings.state_dir, "admin").read_text().strip()
    address = settings.metrics_address("deploy")
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port))):
        scraped = scrape(f"https://{address}/metrics", admin, client_tls(pki), timeout=5)
    assert b"iserve_grpc_server_handled_total" in scraped


def client_tls(
    pki: dict[str, Path], *, certificate: bool = True, presents: dict[str, Path] | None = None
) -> ssl.SSLContext:
    """A client context trusting the stack's CA, presenting the stack's certificate (or
    ``presents``'s, or none)."""
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    identity = presents or (pki if certificate else None)
    if identity is not None:
        context.load_cert_chain(str(identity["cert"]), str(identity["key"]))
    return context


def scrape(url: str, token: str, context: ssl.SSLContext, timeout: float = 10) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
        assert reply.status == 200
        return reply.read()


def test_the_gateway_reaches_the_services_over_mutual_tls(tls_stack, tls_deployed):
    """The HTTP gateway is a client of the scheduler, deployer and model service: over
    the stack's TLS it forwards a client's token and streams a completion."""
    import httpx

    settings, _pki, _root = tls_stack
    admin = token_file(settings.state_dir, "admin").read_text().strip()
    with httpx.Client(timeout=60) as client:
        reply = client.post(
            f"http://{settings.gateway_address}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
            headers={"Authorization": f"Bearer {admin}"},
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3


def test_status_without_tls_settings_says_the_stack_answers_only_tls(tls_stack):
    """A client without ISERVE_TLS_* got every service DOWN and http:// metrics, with no
    word of TLS, from a stack that serves it."""
    settings, _pki, _root = tls_stack
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISERVE_TLS_")}
    env["ISERVE_STATE_DIR"] = str(settings.state_dir)
    out = run_cli(env, "status", timeout=120)
    assert out.returncode == 1
    assert "answers only TLS: this client has no ISERVE_TLS_* set; set ISERVE_TLS_CA" in (
        out.stdout + out.stderr
    ), out
