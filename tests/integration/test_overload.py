"""Overload without loss, over loopback on the real stack: several clients (each its own
channel) with mixed priorities and deadlines flood one EDF deployment whose queue holds 2;
every request gets its tokens or an explicit status, the clients' tally equals the
scheduler's counters exactly, and once the deployment is removed every device's
reservation is what it was before. (bench/load_test.py prints the same at scale.)"""

from __future__ import annotations

import asyncio

from bench import _stack_harness as h
from services.api import common_pb2 as common
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
VOCAB = h.MODEL_SHAPE["vocab_size"]  # the harness's prompts use ids below it


def test_overload_every_request_is_accounted_for_and_nothing_leaks(stack):
    before = reserved_by_device(stack)
    register(stack, "load-llama", make_checkpoint(stack, "load-llama", vocab_size=VOCAB))
    dep = deploy(
        stack,
        "load-llama",
        objectives=common.ServiceObjectives(scheduling=common.SCHEDULING_POLICY_EDF),
    ).deployment
    served = h.Served(dep.deployment_id, "edf", 0, dep.config.batch_size, 64, TOKENS)
    # A deadline the decode of TOKENS meets alone (tens of ms here), which waiting in
    # the queue may pass: refused as late (DEADLINE_EXCEEDED). One of 2 ms, which no
    # decode of 12 tokens meets, is the client's to change (INVALID_ARGUMENT).
    per_client = h.mixed_jobs(CLIENTS, PER_CLIENT, 8, TOKENS, deadline_ms=200)
    outcomes, seconds = asyncio.run(
        h.clients_closed_loop(stack.settings.address("scheduler"), served, per_client, 120.0)
    )
    jobs = [job for jobs in per_client for job in jobs]
    tally = h.tally(jobs, outcomes)
    print(f"load: {tally.line()} in {seconds:.1f} s")
    assert tally.sent == CLIENTS * PER_CLIENT
    assert tally.reconciles, tally.line()  # tokens or RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED
    assert tally.codes["RESOURCE_EXHAUSTED"] > 0, f"the queue never filled: {tally.line()}"
    assert tally.completed > 0
    assert any(j.priority for j in jobs) and any(j.deadline_ms for j in jobs)

    # The scheduler counted exactly what the clients saw, tokens included.
    samples = scrape(stack.settings.metrics_address("scheduler"))
    counted = h.scheduler_counts(samples, dep.deployment_id)
    tokens = counted.pop("tokens", 0.0)
    assert counted == {code: float(n) for code, n in tally.codes.items()}
    assert tokens == sum(o.tokens for o in outcomes)
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
