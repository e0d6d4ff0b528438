"""PlanDeployment by intent against simulated devices, with MaverIQ's A6000 profiles.

Eight simulated RTX A6000s (NVML's 49,140 MiB each), nothing launched. The deployer asks the estimator to
rank the imported model's configurations and places the best one the engine can run;
these tests check the winner against the estimates themselves (EstimateConfigs), the
accuracy floor, and the hybrid placement policy at low and high load.
"""

from __future__ import annotations

import math

import grpc
import pytest

from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import estimator_service_pb2 as estimator_pb
from services.api import estimator_service_pb2_grpc
from services.importers.maveriq import RTX_A6000_DEVICE_BYTES
from tests.integration.conftest import A6000
from tests.integration.helpers import cli, deploy, reserved_by_device, rid

pytestmark = pytest.mark.integration

MODEL = "llama-2-7b"
OUTPUT = 100
DEVICE_BYTES = RTX_A6000_DEVICE_BYTES
PRE_QUANTIZED = {common.WEIGHT_QUANT_GPTQ_INT4, common.WEIGHT_QUANT_AWQ_INT4}


def devices(loads=(0.0,) * 8, free=None) -> list[common.DeviceState]:
    return [
        common.DeviceState(
            ref=common.DeviceRef(node_id="box", device_id=f"cuda{i}"),
            kind=common.DEVICE_KIND_CUDA,
            hardware_type=A6000,
            total_bytes=DEVICE_BYTES,
            free_bytes=DEVICE_BYTES if free is None else free[i],
            load=load,
        )
        for i, load in enumerate(loads)
    ]


def plan(stack, intent=None, config=None, **fields) -> deploy_pb.DeploymentDecision:
    fields.setdefault("devices", devices())
    fields.setdefault("model_id", MODEL)
    fields.setdefault("batch_size", 1)  # the ranking's batch; batch 0 is sized afterwards
    request = deploy_pb.PlanDeploymentRequest(
        request_id=rid(), max_output_tokens=OUTPUT, max_input_tokens=0, **fields
    )
    if intent is not None:
        request.intent.CopyFrom(intent)
    if config is not None:
        request.config.CopyFrom(config)
    return stack.deployments.PlanDeployment(request, timeout=60).decision


@pytest.fixture(scope="module")
def estimates(stack, imported) -> list[estimator_pb.ConfigEstimate]:
    """Every configuration of the model on the 8 A6000s, as the deployer's request sees it."""
    channel = grpc.insecure_channel(stack.settings.address("estimator"))
    try:
        reply = estimator_service_pb2_grpc.EstimatorServiceStub(channel).EstimateConfigs(
            estimator_pb.EstimateConfigsRequest(
                request_id=rid(),
                model_id=MODEL,
                hardware_type=A6000,
                workload=estimator_pb.Workload(input_tokens=512, output_tokens=OUTPUT),
                device_count=8,
            ),
            timeout=60,
        )
    finally:
        channel.close()
    return list(reply.estimates)


def key_of(config: common.DeploymentConfig) -> tuple:
    return (config.tensor_parallel, config.pipeline_parallel, config.variant_name)


def runnable(estimates, decision) -> list[estimator_pb.ConfigEstimate]:
    """Estimates the PyTorch engine can run and the decision did not skip for room."""
    no_room = {key_of(s.config) for s in decision.skipped if s.reason.startswith("no room")}
    return [
        e
        for e in estimates
        if e.config.weight_quant not in PRE_QUANTIZED and key_of(e.config) not in no_room
    ]


def gb_s(e: estimator_pb.ConfigEstimate) -> float:
    return e.cost_memory_latency


def devices_of(e: estimator_pb.ConfigEstimate) -> int:
    return e.config.tensor_parallel * e.config.pipeline_parallel


@pytest.mark.parametrize(
    "kind, metric",
    [
        (common.INTENT_KIND_MIN_LATENCY, lambda e: e.latency_ms),
        (common.INTENT_KIND_MIN_MEMORY, lambda e: e.memory_total_bytes),
        (common.INTENT_KIND_MIN_COST, gb_s),
        (common.INTENT_KIND_MIN_DEVICE_HOURS, lambda e: e.cost_device_hours),
        (
            common.INTENT_KIND_MAX_THROUGHPUT,
            lambda e: -e.throughput_tokens_per_second_per_device,
        ),
    ],
)
def test_each_intent_picks_the_best_configuration_by_the_estimates(stack, estimates, kind, metric):
    decision = plan(stack, common.Intent(kind=kind))
    candidates = runnable(estimates, decision)
    best = min(metric(e) for e in candidates)
    assert metric(decision.estimate) == pytest.approx(best, rel=1e-9), decision
    # Every better-ranked configuration is explained.
    assert [s.rank for s in decision.skipped] == list(range(1, decision.winner_rank))
    assert all(s.reason for s in decision.skipped)
    # The placement holds tp x pp distinct devices, and each stage reserves memory.
    config = decision.config
    refs = [(d.node_id, d.device_id) for s in decision.placement.stages for d in s.devices]
    assert len(refs) == len(set(refs)) == config.tensor_parallel * config.pipeline_parallel
    assert sum(s.layer_count for s in decision.placement.stages) == 32


def test_latency_slo_takes_the_cheapest_under_it_or_says_it_falls_back(stack, estimates):
    fastest = min(e.latency_ms for e in estimates if e.config.weight_quant not in PRE_QUANTIZED)
    slo = fastest * 1.5
    decision = plan(stack, common.Intent(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=slo))
    under = [e for e in runnable(estimates, decision) if e.latency_ms <= slo]
    assert decision.estimate.latency_ms <= slo
    assert gb_s(decision.estimate) == pytest.approx(min(gb_s(e) for e in under), rel=1e-9)
    missed = plan(
        stack, common.Intent(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=fastest / 10)
    )
    assert "no configuration meets the latency SLO" in missed.note
    assert missed.estimate.latency_ms == pytest.approx(fastest, rel=1e-9)
    # Its requests are not all refused as late against the target it misses.
    deadline = math.ceil(1.5 * missed.estimate.latency_ms)
    assert f"requests without a deadline of their own default to {deadline} ms" in missed.note


def test_cost_slo_takes_the_fastest_within_the_budget(stack, estimates):
    costs = sorted(gb_s(e) for e in estimates if e.config.weight_quant not in PRE_QUANTIZED)
    budget = costs[len(costs) // 2]
    decision = plan(stack, common.Intent(kind=common.INTENT_KIND_COST_SLO, cost_budget=budget))
    within = [e for e in runnable(estimates, decision) if gb_s(e) <= budget]
    assert gb_s(decision.estimate) <= budget
    assert decision.estimate.latency_ms == pytest.approx(min(e.latency_ms for e in within))


def test_the_accuracy_floor_excludes_int4_below_it(stack, estimates):
    # Llama-2-7B: int4 keeps 87.1 % of FP16's MMLU, GPTQ 87.3 %, int8 99.8 %.
    cheapest = plan(stack, common.Intent(kind=common.INTENT_KIND_MIN_MEMORY))
    assert cheapest.config.variant_name.startswith("int4"), cheapest.config
    floored = plan(stack, common.Intent(kind=common.INTENT_KIND_MIN_MEMORY, min_accuracy=90))
    assert not floored.config.variant_name.startswith("int4"), floored.config
    assert floored.estimate.accuracy_score >= 90
    above_floor = [
        e
        for e in runnable(estimates, floored)
        if e.HasField("accuracy_score") and e.accuracy_score >= 90
    ]
    assert floored.estimate.memory_total_bytes == min(e.memory_total_bytes for e in above_floor)

    with pytest.raises(grpc.RpcError) as err:
        plan(stack, common.Intent(kind=common.INTENT_KIND_MIN_MEMORY, min_accuracy=100.5))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "accuracy floor of 100.5 (best available: 100)" in err.value.details()
    relaxed = plan(
        stack,
        common.Intent(
            kind=common.INTENT_KIND_MIN_MEMORY,
            min_accuracy=100.5,
            allow_best_available_accuracy=True,
        ),
    )
    assert "ranking the most accurate available (100)" in relaxed.note
    assert relaxed.estimate.accuracy_score == 100
    # The fallback says which part of the intent it misses, through the estimator's
    # RankedConfig and the deployer's note.
    assert "is a fallback: its accuracy 100 is under the floor of 100.5" in relaxed.note


def chosen_devices(decision) -> set[str]:
    return {d.device_id for s in decision.placement.stages for d in s.devices}


TP2 = common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=1)


def test_hybrid_packs_at_low_load_and_spreads_at_high_load(stack, imported):
    low = plan(stack, config=TP2, devices=devices([0.6, 0.5, 0.2, 0.1, 0, 0, 0, 0]))
    assert chosen_devices(low) == {"cuda0", "cuda1"}
    high = plan(stack, config=TP2, devices=devices([0.9, 0.95, 0.8, 0.85, 0.99, 0.75, 0.72, 0.9]))
    assert chosen_devices(high) == {"cuda5", "cuda6"}
    mixed = plan(stack, config=TP2, devices=devices([0.9, 0.9, 0.65, 0.1, 0.9, 0.9, 0.9, 0.9]))
    assert chosen_devices(mixed) == {"cuda2", "cuda3"}
    # The other policies on the low-load cluster.
    loads = [0.6, 0.5, 0.2, 0.1, 0, 0, 0, 0]
    least = plan(
        stack,
        config=TP2,
        devices=devices(loads),
        placement_policy=common.PLACEMENT_POLICY_LEAST_LOADED,
    )
    assert all(loads[int(d[4:])] == 0 for d in chosen_devices(least))


def test_fragmented_simulated_devices_get_an_uneven_layer_map(stack, imported):
    # Llama-2-7B fp16 over pp=2: about 6.7 GB a stage when even; one device has room
    # for only a few layers, so the split follows the free memory.
    free = [2_500_000_000, 48_000_000_000] + [0] * 6
    config = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=2)
    decision = plan(stack, config=config, devices=devices(free=free)[:2])
    counts = [s.layer_count for s in decision.placement.stages]
    assert sum(counts) == 32 and min(counts) >= 1 and counts[0] < 16, counts
    assert "uneven layer map" in decision.note
    for stage in decision.placement.stages:
        device = int(stage.devices[0].device_id[4:])
        assert stage.reserved_bytes[0] <= free[device]


def test_nothing_fits_is_resource_exhausted_with_the_reasons(stack, imported):
    with pytest.raises(grpc.RpcError) as err:
        plan(
            stack,
            common.Intent(kind=common.INTENT_KIND_MIN_LATENCY),
            devices=devices(free=[100_000_000] * 8),
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no configuration of llama-2-7b can be placed" in err.value.details()
    assert "no room" in err.value.details()


@pytest.mark.parametrize(
    "fields, phrase",
    [
        ({"intent": common.Intent(kind=42)}, "intent kind is unspecified or unknown"),
        (
            {"intent": common.Intent(kind=common.INTENT_KIND_LATENCY_SLO)},
            "needs a positive latency_slo_ms",
        ),
        (
            # In seconds it is 0.0, which the estimator refused as INTERNAL (a probe).
            {"intent": common.Intent(kind=common.INTENT_KIND_LATENCY_SLO, latency_slo_ms=5e-324)},
            "latency_slo_ms must be at least 0.001 (a microsecond), got 5e-324",
        ),
        (
            {
                "intent": common.Intent(kind=common.INTENT_KIND_MIN_COST),
                "devices": [common.DeviceState(total_bytes=1, hardware_type=A6000)],
            },
            "needs a device_id",
        ),
        (
            {"intent": common.Intent(kind=common.INTENT_KIND_MIN_COST), "placement_policy": 9},
            "unknown placement policy",
        ),
        (
            {
                "intent": common.Intent(kind=common.INTENT_KIND_MIN_COST),
                "devices": [
                    common.DeviceState(ref=common.DeviceRef(device_id="d0"), total_bytes=1)
                ],
            },
            "needs hardware_type and total_bytes",
        ),
        (
            {
                "intent": common.Intent(kind=common.INTENT_KIND_MIN_COST),
                "devices": [
                    common.DeviceState(
                        ref=common.DeviceRef(device_id="d0"),
                        total_bytes=1,
                        hardware_type=A6000,
                        load=1.5,
                    )
                ],
            },
            "load must be in [0, 1]",
        ),
    ],
)
def test_bad_plan_requests_are_invalid_arguments(stack, imported, fields, phrase):
    intent = fields.pop("intent")
    with pytest.raises(grpc.RpcError) as err:
        plan(stack, intent, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert phrase in err.value.details()


def test_cli_plan_prints_the_decision(stack, imported):
    # The CLI plans against the live cluster, which has no A6000s: the model is not
    # profiled on its CPU devices, which it says.
    out = cli(stack, "deploy", MODEL, "--intent", "min-latency", "--plan")
    assert out.returncode != 0
    assert "not profiled on cpu-x86_64" in out.stderr


def test_batch_0_is_sized_by_the_tpot_objective_on_the_placed_devices(stack, imported):
    # Min-cost: a min-latency intent also keeps TTFT near batch 1's (a bound of its own).
    free = plan(stack, common.Intent(kind=common.INTENT_KIND_MIN_COST), batch_size=1)
    sized = plan(
        stack,
        common.Intent(kind=common.INTENT_KIND_MIN_COST),
        batch_size=0,
        objectives=common.ServiceObjectives(tpot_slo_ms=int(free.estimate.tpot_ms * 1.2) + 1),
    )
    assert sized.config.batch_size > 1
    assert f"batch {sized.config.batch_size}: " in sized.note
    assert sized.estimate.memory_total_bytes > free.estimate.memory_total_bytes
    placed = {(d.node_id, d.device_id) for s in free.placement.stages for d in s.devices}
    assert {(d.node_id, d.device_id) for s in sized.placement.stages for d in s.devices} == placed


def test_what_fits_is_judged_by_the_simulated_devices_memory(stack, imported):
    """Llama-2-70B in float16 (about 129 GiB) on one simulated device: with 200 GiB it
    fits, so an accuracy floor only fp16 reaches is met; with 48 GiB nothing at that floor
    fits. The estimator once judged fit by the live devices or the calibration's device memory
    whatever the simulated devices said."""
    floor = common.Intent(kind=common.INTENT_KIND_MIN_LATENCY, min_accuracy=100)

    def one_device(gib: int) -> list[common.DeviceState]:
        (device,) = devices(loads=(0.0,))
        device.total_bytes = device.free_bytes = gib << 30
        return [device]

    decision = plan(stack, floor, model_id="llama-2-70b", devices=one_device(200))
    assert decision.config.variant_name == "fp16", decision.config
    assert (decision.config.tensor_parallel, decision.config.pipeline_parallel) == (1, 1)
    with pytest.raises(grpc.RpcError) as err:
        plan(stack, floor, model_id="llama-2-70b", devices=one_device(48))
    assert err.value.code() in (
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ), err.value.details()
    # Nothing of any variant fits 1 GiB: the refusal says by how much (it said only
    # "no configuration of llama-2-70b to place").
    with pytest.raises(grpc.RpcError) as err:
        plan(
            stack,
            common.Intent(kind=common.INTENT_KIND_MIN_COST),
            model_id="llama-2-70b",
            devices=one_device(1),
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no configuration of llama-2-70b to place (" in err.value.details()
    assert "no configuration fits the device memory: the least any needs is" in (
        err.value.details()
    )


def test_one_small_device_beside_large_ones_does_not_rule_out_what_the_large_ones_hold(
    stack, imported
):
    """Llama-2-70B, fp16 only (about 129 GiB), on one 200 GiB device beside a 1 GiB one
    of the same type: placed on the large one. Ranking once judged every configuration
    against the smallest device of the type, so nothing was left to place."""
    floor = common.Intent(kind=common.INTENT_KIND_MIN_LATENCY, min_accuracy=100)
    large, small = devices(loads=(0.0, 0.0))
    large.total_bytes = large.free_bytes = 200 << 30
    small.total_bytes = small.free_bytes = 1 << 30
    decision = plan(stack, floor, model_id="llama-2-70b", devices=[large, small])
    assert decision.config.variant_name == "fp16", decision.config
    assert [d.device_id for s in decision.placement.stages for d in s.devices] == [
        large.ref.device_id
    ]


def test_replicas_that_do_not_fit_make_the_plan_take_the_next_configuration(stack, imported):
    """Two replicas of Llama-2-70B on 48 GB devices too few for two of the cheapest
    configuration: the plan goes on down the ranking, as a deploy does, to one whose two
    replicas fit (it was refused naming replica 1). Which configuration is cheapest
    depends on the calibration other tests may have fitted, so the device count is
    found: the first from 2 up that cannot hold two of its own winner."""
    intent = common.Intent(kind=common.INTENT_KIND_MIN_COST)
    for count in range(2, 9):
        alone = plan(stack, intent, model_id="llama-2-70b", devices=devices((0.0,) * count))
        if 2 * alone.config.tensor_parallel * alone.config.pipeline_parallel > count:
            break
    else:
        pytest.fail("every device count from 2 to 8 holds two of its cheapest configuration")
    pair = plan(stack, intent, model_id="llama-2-70b", devices=devices((0.0,) * count), replicas=2)
    assert pair.winner_rank > alone.winner_rank
    assert any(
        s.rank == alone.winner_rank and "replica 2 of 2" in s.reason for s in pair.skipped
    ), pair.skipped
    used = [
        {d.device_id for s in where.stages for d in s.devices}
        for where in (pair.placement, *pair.replica_placements)
    ]
    assert len(used) == 2 and not used[0] & used[1]


def test_deploying_an_imported_model_says_how_to_deploy_it_and_reserves_nothing(stack, imported):
    before = reserved_by_device(stack)
    with pytest.raises(grpc.RpcError) as err:
        deploy(stack, "llama-2-70b")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "register its checkpoint under another model id" in err.value.details()
    assert reserved_by_device(stack) == before


def test_a_plan_on_more_devices_than_the_cluster_sizes_the_batch_of_what_it_chose(stack, imported):
    """The chosen configuration's batch-1 and batch-2 estimates were asked for the live
    cluster's device count: on 16 simulated devices an 8x2 choice found none and stayed
    at batch 1 with a false "no estimate" note."""
    sized = plan(
        stack,
        common.Intent(kind=common.INTENT_KIND_MIN_LATENCY),
        model_id="llama-2-70b",
        batch_size=0,
        devices=devices((0.0,) * 16),
    )
    assert devices_of(sized) > 8, sized.note  # beyond the default count of 8
    assert "no estimate" not in sized.note
    # Sized on the estimates (a min-latency intent keeps TTFT near batch 1's).
    assert f"batch {sized.config.batch_size}: bounded by 1.5x the batch-1 TTFT" in sized.note


@pytest.mark.parametrize("batch", [1, 4])
def test_an_explicit_configuration_shows_the_estimate_of_its_batch(stack, imported, batch):
    """An explicit configuration at batch 1 (or at a batch it gave) showed no estimate
    although its model is profiled, and its memory figures mixed the reservations with
    the estimate (a probe)."""
    config = common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=2, batch_size=batch)
    decision = plan(stack, config=config, batch_size=batch)
    e = decision.estimate
    assert e.latency_ms > 0 and e.ttft_ms > 0 and e.tpot_ms > 0, decision
    assert e.config.batch_size == batch
    reserved = [b for s in decision.placement.stages for b in s.reserved_bytes]
    # The estimator's figures, the engine's alone; each rank reserves at least that (it
    # reserved the shape's figure alone, 4.2 GiB against 4.9 estimated).
    assert 0 < e.memory_per_device_bytes <= min(reserved)
    assert e.memory_per_device_bytes < e.memory_total_bytes <= sum(reserved)


def test_a_cost_budget_only_batching_reaches_is_met_by_batching(stack, imported, estimates):
    """Ranked at batch 1, a cost-slo budget below every configuration's batch-1 cost
    fell back to min cost at a batch capped near batch 1's TTFT, and was reported unmet
    though min-cost's own deployment met it (a probe)."""
    cheapest = min(e.cost_memory_latency for e in estimates if e.cost_memory_latency > 0)
    budget = cheapest / 2
    intent = common.Intent(
        kind=common.INTENT_KIND_COST_SLO,
        cost_budget=budget,
        cost_formula=common.COST_FORMULA_MEMORY_TIMES_LATENCY,
    )
    decision = plan(stack, intent, batch_size=0)
    assert decision.config.batch_size > 1, decision.note
    assert decision.estimate.cost_memory_latency <= budget, decision
    assert "met from this batch on" in decision.note, decision.note
