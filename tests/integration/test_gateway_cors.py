"""A gateway started with ISERVE_CORS_ORIGINS answers browsers' CORS preflights for
those origins only; the stack's own gateway (no origins set) sends no CORS headers."""

from __future__ import annotations

import httpx
import pytest

from services.settings import CORS_ENV
from tests.integration.helpers import own_gateway

pytestmark = pytest.mark.integration

PAGE = "http://localhost:3000"
PREFLIGHT = {
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type",
}


@pytest.fixture(scope="module")
def cors_gateway(stack):
    with own_gateway(stack, {CORS_ENV: f"{PAGE}, https://x.test"}) as url:
        yield url


def test_a_listed_origin_may_call_and_another_may_not(cors_gateway):
    url = f"{cors_gateway}/v1/chat/completions"
    allowed = httpx.options(url, headers={"origin": PAGE, **PREFLIGHT}, timeout=10)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == PAGE
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in allowed.headers

    # The headers the OpenAI SDKs send from a browser (openai-node's x-stainless-*): a
    # preflight naming them was refused (400 Disallowed CORS headers), so the SDK failed.
    sdk = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "accept,authorization,content-type,"
        "x-stainless-arch,x-stainless-lang,x-stainless-os,x-stainless-package-version,"
        "x-stainless-retry-count,x-stainless-runtime,x-stainless-runtime-version,"
        "x-stainless-timeout",
    }
    from_sdk = httpx.options(url, headers={"origin": PAGE, **sdk}, timeout=10)
    assert from_sdk.status_code == 200, from_sdk.text
    assert from_sdk.headers["access-control-allow-origin"] == PAGE

    refused = httpx.options(url, headers={"origin": "http://evil.test", **PREFLIGHT}, timeout=10)
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers

    listed = httpx.get(f"{cors_gateway}/v1/models", headers={"origin": PAGE}, timeout=10)
    assert listed.status_code == 200
    assert listed.headers["access-control-allow-origin"] == PAGE


def test_without_origins_no_cors_headers(stack):
    gateway = f"http://{stack.settings.gateway_address}"
    reply = httpx.get(f"{gateway}/v1/models", headers={"origin": PAGE}, timeout=10)
    assert "access-control-allow-origin" not in reply.headers
    preflight = httpx.options(
        f"{gateway}/v1/chat/completions", headers={"origin": PAGE, **PREFLIGHT}, timeout=10
    )
    assert "access-control-allow-origin" not in preflight.headers
