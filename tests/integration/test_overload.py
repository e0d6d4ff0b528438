"""Overload without loss, over loopback on the real stack: several clients with mixed
priorities and deadlines flood one deployment whose queue holds 2; every request gets its
tokens or an explicit status, the client's tally equals the scheduler's exactly, and once
the deployment is removed every device's reservation is what it was before."""

from __future__ import annotations

import grpc

from bench.load import EXPLICIT, run_load, scheduler_counts
from services.api import deployment_service_pb2 as deploy_pb
from tests.integration.helpers import (
    deploy,
    make_checkpoint,
    register,
    reserved_by_device,
    wait_for,
)
from tests.integration.test_metrics import scrape, value

CLIENTS = 8
PER_CLIENT = 6
TOKENS = 12


def test_overload_every_request_is_accounted_for_and_nothing_leaks(stack):
    before = reserved_by_device(stack)
    register(stack, "load-llama", make_checkpoint(stack, "load-llama"))
    dep = deploy(stack, "load-llama").deployment
    address = stack.settings.address("scheduler")

    result = run_load(
        lambda: grpc.insecure_channel(address),
        {"deployment_id": dep.deployment_id},
        clients=CLIENTS,
        per_client=PER_CLIENT,
        max_tokens=TOKENS,
        call_timeout_s=120,
    )
    codes = result.by_code()
    print(f"load: {codes} in {result.wall_s:.1f} s")
    assert sum(codes.values()) == CLIENTS * PER_CLIENT
    assert result.lost == [], f"requests without their tokens or a status: {result.lost[:3]}"
    assert set(codes) <= EXPLICIT, codes
    assert codes.get("RESOURCE_EXHAUSTED", 0) > 0, f"the queue never filled: {codes}"
    assert codes.get("OK", 0) > 0, codes
    for outcome in result.outcomes:
        if outcome.code == "OK":
            assert outcome.tokens == TOKENS
        elif outcome.code == "RESOURCE_EXHAUSTED":
            assert outcome.tokens == 0 and "queue" in outcome.detail.lower(), outcome

    # The scheduler counted exactly what the clients saw, tokens included.
    samples = scrape(stack.settings.metrics_address("scheduler"))
    counted = scheduler_counts(samples, dep.deployment_id)
    tokens = counted.pop("tokens", 0)
    assert counted == {code: float(n) for code, n in codes.items()}
    assert tokens == result.tokens
    labels = {"model_id": "load-llama", "deployment_id": dep.deployment_id}
    assert value(samples, "iserve_num_requests_running", **labels) == 0
    assert value(samples, "iserve_num_requests_waiting", **labels) == 0

    stack.deployments.RemoveDeployment(
        deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
    )
    assert wait_for(lambda: reserved_by_device(stack) == before, timeout=30), (
        before,
        reserved_by_device(stack),
    )
