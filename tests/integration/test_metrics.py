"""Prometheus metrics on the live stack, scraped over HTTP with a real HTTP client.

After a known batch of requests the scheduler's counters and histograms moved by exactly
what was sent (the scrape before is subtracted: other tests share the stack), every
service answers at its metrics address, the agent exports its devices and workers, and
``iserve status`` shows the deployment's queue, TTFT percentiles and request counts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import inference_service_pb2 as infer_pb
from services.api import model_service_pb2 as model_pb
from tests.integration.helpers import (
    cli,
    deploy,
    generate,
    make_checkpoint,
    register,
    rid,
    wait_for,
)

pytestmark = pytest.mark.integration

GREEDY_NO_EOS = common.SamplingParams(ignore_eos=True)
# (prompt tokens, output tokens) of each request sent.
REQUESTS = [(3, 4), (7, 2), (5, 6), (1, 1)]


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    """Every sample at http://address/metrics, keyed by (name, labels)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_scheduler_metrics_count_exactly_what_was_sent(stack, served):
    address = stack.settings.metrics_address("scheduler")
    ids = {"model_id": served.model_id, "deployment_id": served.deployment_id}
    before = scrape(address)
    messages = []
    for prompt_len, tokens in REQUESTS:
        deltas, final = generate(
            stack,
            deployment_id=served.deployment_id,
            prompt_token_ids=list(range(10, 10 + prompt_len)),
            max_tokens=tokens,
            sampling=GREEDY_NO_EOS,
        )
        assert final.usage.completion_tokens == tokens
        messages.append(len(deltas))
    with pytest.raises(grpc.RpcError) as refused:
        generate(
            stack,
            deployment_id=served.deployment_id,
            prompt="hello",
            max_tokens=served.max_output_tokens + 1,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(address)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    sent = len(REQUESTS)
    assert moved("iserve_request_success_total", **ids, finished_reason="length") == sent
    assert moved("iserve_prompt_tokens_total", **ids) == sum(p for p, _ in REQUESTS)
    assert moved("iserve_generation_tokens_total", **ids) == sum(t for _, t in REQUESTS)
    for histogram in (
        "iserve_time_to_first_token_seconds",
        "iserve_e2e_request_latency_seconds",
        "iserve_request_queue_time_seconds",
    ):
        assert moved(f"{histogram}_count", **ids) == sent, histogram
        assert moved(f"{histogram}_bucket", **ids, le="+Inf") == sent, histogram
        assert moved(f"{histogram}_sum", **ids) >= 0
    gaps = sum(m - 1 for m in messages)
    assert moved("iserve_inter_token_latency_seconds_count", **ids) == gaps
    assert moved("iserve_request_failure_total", **ids, code="INVALID_ARGUMENT") == 1
    # The served deployment has no objective: nothing counts for or against goodput.
    assert moved("iserve_slo_attained_total", **ids) == 0
    assert moved("iserve_slo_missed_total", **ids) == 0
    handled = {"grpc_service": "iserve.v1.InferenceService", "grpc_method": "Generate"}
    assert moved("iserve_grpc_server_handled_total", **handled, grpc_code="OK") == sent
    assert moved("iserve_grpc_server_handled_total", **handled, grpc_code="INVALID_ARGUMENT") == 1
    assert value(after, "iserve_num_requests_running", **ids) == 0
    assert value(after, "iserve_num_requests_waiting", **ids) == 0
    assert value(after, "process_resident_memory_bytes") > 0


def test_a_stop_string_ends_a_generation_that_counts_as_a_success(stack, served):
    """The worker ends the generation at the stop string: a finished request
    (finished_reason "stop"), not a call cancelled and counted as a failure, as when the
    gateway applied stop strings by hanging up."""
    address = stack.settings.metrics_address("scheduler")
    ids = {"model_id": served.model_id, "deployment_id": served.deployment_id}
    run = {
        "deployment_id": served.deployment_id,
        "prompt": "The river runs past the old mill",
        "max_tokens": 16,
    }
    deltas, whole = generate(stack, **run, sampling=GREEDY_NO_EOS)
    text = "".join(d.text for d in deltas)
    # Two characters of its second half whose first occurrence is not at the start.
    middle = range(len(text) // 2, len(text) - 1)
    stop = next((text[k : k + 2] for k in middle if text.find(text[k : k + 2]) > 0), "")
    if not stop:
        pytest.skip(f"the random model's greedy text has nothing to cut at: {text!r}")
    before = scrape(address)
    sampling = common.SamplingParams(ignore_eos=True, stop=[stop])
    deltas, final = generate(stack, **run, sampling=sampling)
    after = scrape(address)
    assert "".join(d.text for d in deltas) == text[: text.find(stop)]
    assert final.finish_reason == common.FINISH_REASON_STOP
    assert 1 <= final.usage.completion_tokens < whole.usage.completion_tokens

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("iserve_request_success_total", **ids, finished_reason="stop") == 1
    assert moved("iserve_request_failure_total", **ids, code="CANCELLED") == 0
    with pytest.raises(grpc.RpcError) as refused:
        generate(stack, **run, sampling=common.SamplingParams(stop=["a", "b", "c", "d", "e"]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.stop: at most 4 stop strings, got 5" in refused.value.details()


def test_slo_attainment_is_counted_per_deployment(stack, served):
    """A request's own deadline is an objective: a generous one is attained."""
    address = stack.settings.metrics_address("scheduler")
    ids = {"model_id": served.model_id, "deployment_id": served.deployment_id}
    before = scrape(address)
    generate(
        stack,
        deployment_id=served.deployment_id,
        prompt_token_ids=[5, 6, 7],
        max_tokens=2,
        sampling=GREEDY_NO_EOS,
        deadline_ms=60_000,
    )
    after = scrape(address)
    attained = value(after, "iserve_slo_attained_total", **ids)
    assert attained - value(before, "iserve_slo_attained_total", **ids) == 1
    assert value(after, "iserve_slo_missed_total", **ids) == value(
        before, "iserve_slo_missed_total", **ids
    )


def test_every_service_serves_metrics_and_the_agent_its_devices(stack, served):
    for name in stack.settings.addresses:
        samples = scrape(stack.settings.metrics_address(name))
        assert value(samples, "process_resident_memory_bytes") > 0, name
    agent = scrape(stack.settings.metrics_address("agent"))
    devices = {
        dict(labels)["device_id"]: v
        for (name, labels), v in agent.items()
        if name == "iserve_device_memory_total_bytes"
    }
    assert len(devices) == 2 and all(v == 2 * (1 << 30) for v in devices.values())

    def ready_workers() -> float:
        # The agent updates its gauges each second, with its device monitor.
        samples = scrape(stack.settings.metrics_address("agent"))
        return value(samples, "iserve_workers", node_id=stack.settings.node_id, state="ready")

    assert wait_for(lambda: ready_workers() >= 1, timeout=5)
    # Worker deaths are exported from the start (0 before any), so a rate() sees the first;
    # the session's stack may have seen some by now (tests of other files kill workers).
    deaths = ("iserve_worker_deaths_total", frozenset({"node_id": stack.settings.node_id}.items()))
    assert agent.get(deaths, -1) >= 0
    assert any(name == "iserve_device_load" for name, _ in agent)
    deploy = scrape(stack.settings.metrics_address("deploy"))
    assert any(
        name == "iserve_grpc_server_handled_total" and dict(labels)["grpc_code"] == "OK"
        for (name, labels) in deploy
    )


def test_an_explicit_deploy_of_an_unprofiled_model_asks_the_estimator_nothing(stack):
    """Each such deploy counted, and logged, a FAILED_PRECONDITION of EstimateConfigs."""
    address = stack.settings.metrics_address("estimator")
    asked = {
        "grpc_service": "iserve.v1.EstimatorService",
        "grpc_method": "EstimateConfigs",
        "grpc_code": "FAILED_PRECONDITION",
    }
    before = value(scrape(address), "iserve_grpc_server_handled_total", **asked)
    register(stack, "metrics-unprofiled", make_checkpoint(stack, "metrics-unprofiled"))
    try:
        deployed = deploy(stack, "metrics-unprofiled").deployment
        stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=deployed.deployment_id), timeout=60
        )
    finally:
        stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="metrics-unprofiled"))
    assert value(scrape(address), "iserve_grpc_server_handled_total", **asked) == before


def test_status_shows_queue_ttft_and_requests_per_deployment(stack, served):
    generate(
        stack,
        request_id=rid(),
        deployment_id=served.deployment_id,
        prompt_token_ids=[1, 2],
        max_tokens=2,
        sampling=GREEDY_NO_EOS,
    )
    out = cli(stack, "status", "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    deployment = next(
        d for d in status["deployments"] if d["deployment_id"] == served.deployment_id
    )
    serving = deployment["serving"]
    assert int(serving["requests_completed"]) >= 1
    assert 0 < serving["ttft_p50_ms"] <= serving["ttft_p95_ms"]
    assert serving["requests_waiting"] == 0
    assert status["services"]["scheduler"]["metrics"].endswith("/metrics")
    table = cli(stack, "status")
    assert table.returncode == 0, table.stderr
    assert "TTFT P50/P95 ms" in table.stdout and served.deployment_id in table.stdout


def test_serving_stats_over_grpc(stack, served):
    reply = stack.inference.GetServingStats(infer_pb.GetServingStatsRequest(request_id=rid()))
    assert any(d.deployment_id == served.deployment_id for d in reply.deployments)


def test_ids_a_client_makes_up_do_not_become_series(stack):
    address = stack.settings.metrics_address("scheduler")
    unresolved = {"model_id": "", "deployment_id": "", "code": "NOT_FOUND"}
    before = value(scrape(address), "iserve_request_failure_total", **unresolved)
    for made_up in ("no-such-model-1", "no-such-model-2"):
        with pytest.raises(grpc.RpcError) as refused:
            generate(stack, model_id=made_up, prompt="hi", max_tokens=1)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    after = scrape(address)
    assert value(after, "iserve_request_failure_total", **unresolved) - before == 2
    assert not any("no-such-model" in v for _, labels in after for _, v in labels)


def _watch_status(
    stack, extra_env: dict[str, str], drawn: Callable[[str], bool]
) -> tuple[int, str]:
    """Run ``iserve status --watch 0.3`` until its stdout so far satisfies ``drawn`` (60 s
    at most), then Ctrl-C; (exit code, whole stdout)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "status", "--watch", "0.3"],
        env={**os.environ, **stack.env, **extra_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # Both pipes are drained on threads of their own, so neither can fill and stall it.
    streams = {"out": bytearray(), "err": bytearray()}
    lock = threading.Lock()

    def drain(pipe, into: bytearray) -> None:
        while chunk := os.read(pipe.fileno(), 65536):
            with lock:
                into.extend(chunk)

    readers = [
        threading.Thread(target=drain, args=(pipe, streams[name]), daemon=True)
        for name, pipe in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for reader in readers:
        reader.start()

    def so_far(name: str = "out") -> str:
        with lock:
            return streams[name].decode(errors="replace")

    try:
        seen = wait_for(lambda: drawn(so_far()) or proc.poll() is not None, timeout=60)
        assert seen and proc.poll() is None, (
            f"not redrawn as expected within 60 s (exit {proc.poll()}):\n"
            f"{so_far()}\n{so_far('err')}"
        )
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for reader in readers:
            reader.join(10)
        proc.stdout.close()
        proc.stderr.close()
    return proc.returncode, so_far()


def _plain_blocks(out: str) -> list[str]:
    """The plain-text redraws: each from its ``--- HH:MM:SS`` line to the next."""
    return re.split(r"^--- ", out, flags=re.MULTILINE)[1:]


def test_status_watch_redraws_until_ctrl_c(stack, served):
    # Ctrl-C once two redraws are whole (a third has begun), however long they took.
    code, out = _watch_status(stack, {}, lambda text: len(_plain_blocks(text)) >= 3)
    assert code == 0
    blocks = _plain_blocks(out)
    # Plain text, repeated: a table in each block (the last may be cut by the Ctrl-C).
    assert len(blocks) >= 3 and all(b.count("SERVICE") == 1 for b in blocks[:-1]), out
    assert blocks[-1].count("SERVICE") <= 1, out
    assert "gateway" in out and "\x1b[" not in out
    # On a terminal (forced), rich redraws in place: cursor movements, colours, one header.
    code, out = _watch_status(
        stack,
        {"FORCE_COLOR": "1", "COLUMNS": "200"},
        lambda text: text.count("Ctrl-C stops") >= 2,
    )
    assert code == 0
    assert "\x1b[" in out and out.count("Ctrl-C stops") >= 2 and "--- " not in out
