"""Deploy by intent on the real CPU stack: profile, rank, place, launch, serve, remove.

A small Llama model is registered with an int4 variant and profiled on the node's two
virtual CPU devices; Deploy with min-latency and with min-memory then gets the
configurations the estimates rank first, and both serve. Fragmented devices (memory
held by a reservation the test makes) force an uneven layer map that the workers run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import pytest

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import estimator_service_pb2 as estimator_pb
from services.api import estimator_service_pb2_grpc
from services.api import model_service_pb2 as model_pb
from services.reservation import memory_blocks
from tests.conftest import Stack, running_stack
from tests.integration.helpers import (
    cli,
    deploy,
    generate,
    live_devices,
    make_checkpoint,
    register,
    remove_deployments_of,
    reserved_by_device,
    rid,
    settled_devices,
    with_store,
)

pytestmark = pytest.mark.integration

HARDWARE = "cpu-x86_64"
MODEL = "intent-llama"
SHAPE = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
INT4 = common.CompressionVariant(
    name="int4",
    weight_quant=common.WEIGHT_QUANT_INT4,
    kv_quant=common.KV_QUANT_NONE,
    pruning=common.PRUNING_NONE,
)
MAX_INPUT, MAX_OUTPUT = 64, 32
PROFILE_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    """This module's own stack, profiling on a shorter plan than the default (prompts of
    16 and 64 tokens, the longest this module asks estimates for, and 2 timed runs):
    what is tested here is deploying what the estimates rank first, whatever they
    measured, and the default plan's three prompts made the profile CI's slowest
    setup (100 s). The default plan is profiled in full by test_profiling."""
    with running_stack(
        tmp_path_factory.mktemp("iserve-intent"),
        ISERVE_PROFILE_INPUT_TOKENS=f"16,{MAX_INPUT}",
        ISERVE_PROFILE_TIMED_RUNS="2",
    ) as running:
        yield running


@pytest.fixture(scope="module")
def profiled(stack) -> model_pb.Model:
    if {d.hardware_type for d in live_devices(stack)} != {HARDWARE}:
        pytest.skip(f"the node's devices are not {HARDWARE}")
    path = make_checkpoint(stack, MODEL, **SHAPE)
    stack.models.RegisterModel(
        model_pb.RegisterModelRequest(
            request_id=rid(), model_id=MODEL, checkpoint_path=path, variants=[INT4]
        )
    )
    events = list(
        stack.models.WatchModel(
            model_pb.WatchModelRequest(request_id=rid(), model_id=MODEL), timeout=PROFILE_TIMEOUT_S
        )
    )
    assert events[-1].state == model_pb.MODEL_STATE_PROFILED, events[-1]
    yield stack.models.GetModel(model_pb.GetModelRequest(model_id=MODEL)).model
    remove_deployments_of(stack, MODEL)
    stack.models.DeleteModel(model_pb.DeleteModelRequest(request_id=rid(), model_id=MODEL))


def ranked(stack, kind: int) -> list[estimator_pb.RankedConfig]:
    channel = grpc.insecure_channel(stack.settings.address("estimator"))
    try:
        return list(
            estimator_service_pb2_grpc.EstimatorServiceStub(channel)
            .RankConfigs(
                estimator_pb.RankConfigsRequest(
                    request_id=rid(),
                    model_id=MODEL,
                    hardware_type=HARDWARE,
                    workload=estimator_pb.Workload(
                        input_tokens=MAX_INPUT, output_tokens=MAX_OUTPUT
                    ),
                    device_count=len(live_devices(stack)),
                    intent=common.Intent(kind=kind),
                ),
                timeout=60,
            )
            .ranked
        )
    finally:
        channel.close()


def deploy_intent(stack, kind: int) -> deploy_pb.DeployResponse:
    return stack.deployments.Deploy(
        deploy_pb.DeployRequest(
            request_id=rid(),
            model_id=MODEL,
            intent=common.Intent(kind=kind),
            max_input_tokens=MAX_INPUT,
            max_output_tokens=MAX_OUTPUT,
        ),
        timeout=180,
    )


def test_min_latency_and_min_memory_get_different_configurations_and_both_serve(stack, profiled):
    chosen, tops, rankings = {}, {}, {}
    key = {
        common.INTENT_KIND_MIN_LATENCY: lambda e: e.latency_ms,
        common.INTENT_KIND_MIN_MEMORY: lambda e: e.memory_total_bytes,
    }
    try:
        for kind in (common.INTENT_KIND_MIN_LATENCY, common.INTENT_KIND_MIN_MEMORY):
            reply = deploy_intent(stack, kind)
            decision, dep = reply.decision, reply.deployment
            chosen[kind] = dep
            assert dep.state == deploy_pb.DEPLOYMENT_STATE_READY
            # The ranking follows the intent; the winner is the best-ranked configuration
            # that could be placed; the ones before it are explained.
            ranking = rankings[kind] = ranked(stack, kind)
            values = [key[kind](r.estimate) for r in ranking]
            assert values == sorted(values), values
            winner = ranking[decision.winner_rank - 1].estimate.config
            assert (winner.tensor_parallel, winner.pipeline_parallel, winner.variant_name) == (
                dep.config.tensor_parallel,
                dep.config.pipeline_parallel,
                dep.config.variant_name,
            )
            assert [s.rank for s in decision.skipped] == list(range(1, decision.winner_rank))
            top = ranking[0].estimate.config
            tops[kind] = (top.variant_name, top.tensor_parallel, top.pipeline_parallel)
            deltas, final = generate(
                stack,
                deployment_id=dep.deployment_id,
                prompt="hello",
                max_tokens=8,
                sampling=common.SamplingParams(ignore_eos=True),
            )
            assert final.usage.completion_tokens == 8
        fast, small = chosen[common.INTENT_KIND_MIN_LATENCY], chosen[common.INTENT_KIND_MIN_MEMORY]
        # int4 holds less than the same layout unquantized, whatever the timings measured.
        assert small.config.weight_quant == common.WEIGHT_QUANT_INT4, small.config
        # Memory and latency compared at one workload, the rankings' (a deployment's own
        # estimate is at the batch size it was given, which differs between the two: CI
        # compared 160 ms at one batch with 107 ms at another, and 8.96 MB of a batch's
        # KV cache with 8.85 MB of a smaller batch's).
        by_config = {
            (e.config.variant_name, e.config.tensor_parallel, e.config.pipeline_parallel): e
            for e in (r.estimate for r in rankings[common.INTENT_KIND_MIN_LATENCY])
        }

        def ranked_estimate(dep: deploy_pb.Deployment) -> estimator_pb.ConfigEstimate:
            config = dep.config
            return by_config[
                (config.variant_name, config.tensor_parallel, config.pipeline_parallel)
            ]

        assert ranked_estimate(small).memory_total_bytes <= ranked_estimate(fast).memory_total_bytes
        assert ranked_estimate(fast).latency_ms <= ranked_estimate(small).latency_ms
        # Which layout is fastest is measured, so under load int4 at tp=1 pp=1 can rank
        # first on both; when the two rankings differ, so do the deployments.
        if tops[common.INTENT_KIND_MIN_LATENCY] != tops[common.INTENT_KIND_MIN_MEMORY]:
            assert (
                fast.config.variant_name,
                fast.config.tensor_parallel,
                fast.config.pipeline_parallel,
            ) != (
                small.config.variant_name,
                small.config.tensor_parallel,
                small.config.pipeline_parallel,
            )
    finally:
        # A failure here must not leave the devices full for the tests after it.
        for dep in chosen.values():
            stack.deployments.RemoveDeployment(
                deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
            )


def test_cli_deploy_by_intent_plans_and_launches(stack, profiled):
    planned = cli(stack, "deploy", MODEL, "--intent", "min-memory", "--plan", "--max-output", "32")
    assert planned.returncode == 0, planned.stderr
    # The smallest variant, whichever layout: for a model this tiny the layouts' memory
    # estimates are close, and a fresh-clone CI run ranked (1,2) first.
    assert re.match(r"chose #1: tp=\d+ pp=\d+ variant=int4 ", planned.stderr), planned.stderr
    out = cli(stack, "deploy", MODEL, "--intent", "min-memory", "--max-output", "32")
    assert out.returncode == 0, out.stderr
    deployment_id = out.stdout.strip().splitlines()[-1]
    assert cli(stack, "remove", deployment_id).returncode == 0
    clash = cli(stack, "deploy", MODEL, "--intent", "min-memory", "--tp", "2")
    assert clash.returncode != 0 and "do not mix" in clash.stderr


def test_fragmented_devices_get_an_uneven_layer_map_that_serves(stack):
    shape = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}
    model = register(stack, "frag-llama", make_checkpoint(stack, "frag-llama", **shape))
    config = common.DeploymentConfig(
        tensor_parallel=1, pipeline_parallel=2, dtype=common.PRECISION_FLOAT32, batch_size=1
    )
    fixed, block = memory_blocks(model.shape, config, MAX_INPUT + MAX_OUTPUT)
    # Sized from a state published after the previous test's workers stopped: a stale
    # reading of their memory would leave more room than intended once it is republished.
    devices = sorted(settled_devices(stack), key=lambda d: d.ref.device_id)[:2]
    # The first device keeps room for one and a half layers, the second for plenty.
    room = [fixed + block * 3 // 2, fixed + block * 10]
    filler = {
        (d.ref.node_id, d.ref.device_id): d.free_bytes - keep
        for d, keep in zip(devices, room, strict=True)
    }
    owner = f"filler-{rid()}"
    with_store(stack, lambda store: store.reserve(owner, filler))
    try:
        reply = deploy(
            stack,
            "frag-llama",
            config=config,
            max_input_tokens=MAX_INPUT,
            max_output_tokens=MAX_OUTPUT,
        )
        stages = reply.deployment.placement.stages
        assert [s.layer_count for s in stages] == [1, 3]
        assert [s.devices[0].device_id for s in stages] == [d.ref.device_id for d in devices]
        assert "uneven layer map 1+3" in reply.decision.note
        deltas, final = generate(
            stack,
            deployment_id=reply.deployment.deployment_id,
            prompt="fragments",
            max_tokens=6,
            sampling=common.SamplingParams(ignore_eos=True),
        )
        assert final.usage.completion_tokens == 6
        stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=reply.deployment.deployment_id)
        )
    finally:
        with_store(stack, lambda store: store.release(owner))
    stack.models.DeleteModel(model_pb.DeleteModelRequest(request_id=rid(), model_id="frag-llama"))


def test_configurations_that_fail_to_launch_are_rolled_back_and_the_next_tried(stack, profiled):
    before = reserved_by_device(stack)
    with pytest.raises(grpc.RpcError) as err:
        stack.deployments.Deploy(
            deploy_pb.DeployRequest(
                request_id=rid(),
                model_id=MODEL,
                intent=common.Intent(kind=common.INTENT_KIND_MIN_LATENCY),
                max_input_tokens=MAX_INPUT,
                max_output_tokens=MAX_OUTPUT,
                ready_timeout_ms=1,
            ),
            timeout=300,
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    details = err.value.details()
    # Each was placed and failed to start: not "cannot be placed" (a tester).
    assert details.startswith(f"no configuration of {MODEL} could be launched (#1 "), details
    assert "can be placed" not in details, details
    tried = len(ranked(stack, common.INTENT_KIND_MIN_LATENCY))
    assert tried > 1 and details.count("launch failed") == min(tried, 5), details
    assert reserved_by_device(stack) == before
    assert not stack.deployments.ListDeployments(
        deploy_pb.ListDeploymentsRequest(model_id=MODEL)
    ).deployments
