"""The profiler against a real Redis and a fake AgentService: what it reserves, asks,
records, skips and fails on."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest

from fingerprint_svc.profile_plan import ProfilingSettings
from fingerprint_svc.profiler import Profiler
from services.api import agent_service_pb2 as agent_pb
from services.api import agent_service_pb2_grpc
from services.api import common_pb2 as common
from services.api import model_service_pb2 as model_pb
from services.errors import REASON_KEY, WorkerKilled
from services.models.checkpoint import create_checkpoint
from services.settings import load_settings
from services.state.store import StateStore

MIB = 1 << 20
GIB = 1 << 30
SHAPE = {"hidden_size": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2}
SETTINGS = ProfilingSettings(output_tokens=(4, 8), warmup_runs=0, timed_runs=2)


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    create_checkpoint(root / "tiny", **SHAPE)
    return root


@dataclass
class FakeAgent(agent_service_pb2_grpc.AgentServiceServicer):
    """Answers RunProfilingJob with ``answer(request)`` (runs, or (code, message) to abort)
    and notes each request with the reservations held while it ran."""

    store: StateStore
    answer: Callable[[agent_pb.RunProfilingJobRequest], object]
    calls: list[tuple[agent_pb.RunProfilingJobRequest, dict[str, dict[str, int]]]] = field(
        default_factory=list
    )

    async def RunProfilingJob(self, request, context):
        owners = await self.store.reservation_owners()
        held = {o: await self.store.reservation_of(o) for o in owners}
        self.calls.append((request, held))
        result = self.answer(request)
        if asyncio.iscoroutine(result):
            result = await result
        if isinstance(result, tuple):
            await context.abort(*result)
        return agent_pb.RunProfilingJobResponse(request_id=request.request_id, runs=result)


def measured(request: agent_pb.RunProfilingJobRequest) -> list[agent_pb.ProfiledRun]:
    """Plausible runs: latency grows with layers, batch and output length."""
    layers = sum(w.layer_count for w in request.workers) or 1
    batch = request.config.batch_size
    return [
        agent_pb.ProfiledRun(
            input_tokens=n,
            output_tokens=o,
            ttft_ms=2.0 * layers * batch * n / 64,
            tpot_ms=1.0 * layers,
            latency_ms=2.0 * layers * batch * n / 64 + o * layers,
            peak_memory_bytes_per_rank=[(10 + layers + batch) * MIB] * len(request.workers),
        )
        for n in (request.input_tokens, *request.extra_input_tokens)
        for o in request.output_tokens
    ]


def single_rank_only(request):
    if len(request.workers) > 1:
        return (grpc.StatusCode.FAILED_PRECONDITION, "workers on this node run tp = pp = 1 only")
    return measured(request)


def run_profiler(
    redis_url: str,
    models_root,
    answer,
    *,
    devices: int = 2,
    device_bytes: int = 2 * GIB,
    model: model_pb.Model | None = None,
    before: Callable | None = None,
    second_node: Callable | None = None,
    agent_answers_health: bool = False,
):
    """Profile ``model`` (default: the tiny base model) and return what was left behind:
    (model, profile, progress, agent calls, reservation owners). With ``second_node``,
    a node n1 like n0 whose agent answers with it (its calls are listed after n0's)."""

    async def main():
        store = StateStore.from_url(redis_url)
        await store.redis.flushdb()
        servers: list[grpc.aio.Server] = []
        agents = []
        for node_id, answers in (("n0", answer), ("n1", second_node)):
            if answers is None:
                continue
            agent = FakeAgent(store, answers)
            agents.append(agent)
            servicer = grpc.aio.server()
            agent_service_pb2_grpc.add_AgentServiceServicer_to_server(agent, servicer)
            if agent_answers_health:  # the agent itself is there (SERVING)
                from grpc_health.v1 import health, health_pb2_grpc

                health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), servicer)
            port = servicer.add_insecure_port("127.0.0.1:0")
            await servicer.start()
            servers.append(servicer)
            node = common.NodeState(
                node_id=node_id,
                agent_address=f"127.0.0.1:{port}",
                devices=[
                    common.DeviceState(
                        ref=common.DeviceRef(node_id=node_id, device_id=f"cpu{i}"),
                        kind=common.DEVICE_KIND_CPU_VIRTUAL,
                        hardware_type="cpu-test",
                        total_bytes=device_bytes,
                    )
                    for i in range(devices)
                ],
            )
            await store.register_node(node, ttl_s=60)
        try:
            settings = load_settings(
                {"ISERVE_MODELS_ROOT": str(models_root), "ISERVE_STATE_DIR": str(models_root)}
            )
            profiler = Profiler(settings, store, SETTINGS)
            subject = model or model_pb.Model(
                model_id="tiny",
                checkpoint_path="tiny",
                shape=model_pb.ModelShape(**{
                    "num_layers": 3, "num_attention_heads": 4, "num_kv_heads": 2,
                    "intermediate_size": 192,
                }),
            )  # fmt: skip
            await store.create_model(subject)
            if before is not None:
                await before(store, profiler)
            await profiler.start(subject)
            await asyncio.wait_for(asyncio.gather(*profiler._tasks.values()), 60)
            return (
                await store.get_model(subject.model_id),
                await store.get_profile(subject.model_id),
                await store.get_profile_progress(subject.model_id),
                [call for agent in agents for call in agent.calls],
                await store.reservation_owners(),
            )
        finally:
            for servicer in servers:
                await servicer.stop(0)
            await store.close()

    return asyncio.run(main())


def test_profiles_every_job_and_stores_the_raw_measurements(redis_url, models_root):
    model, profile, progress, calls, owners = run_profiler(redis_url, models_root, single_rank_only)

    assert model.state == model_pb.MODEL_STATE_PROFILED and model.state_reason == ""
    assert owners == set()
    # (1,1) ran at 1 and 2 layers, batch 1 and 2; each multi-rank reference was tried once.
    singles = [r for r, _ in calls if len(r.workers) == 1]
    assert [(r.config.batch_size, r.workers[0].layer_count) for r in singles] == [
        (1, 1),
        (2, 1),
        (1, 2),
        (2, 2),
    ]
    assert sorted(len(r.workers) for r, _ in calls) == [1, 1, 1, 1, 2, 2]
    for request, held in calls:
        assert list(request.output_tokens) == [4, 8] and request.input_tokens == 64
        assert list(request.extra_input_tokens) == [256, 1024]  # the default's others
        assert (request.warmup_runs, request.timed_runs) == (0, 2)
        # The fingerprint's layers are timed with the full model's cache footprint.
        assert request.model_layers == model.shape.num_layers > request.workers[0].layer_count
        [(owner, devices)] = held.items()  # reserved before the call, by one owner
        assert owner.startswith("profile-tiny-") and len(devices) == len(request.workers)
        assert all(amount > 512 * MIB for amount in devices.values())
    assert singles[0].checkpoint_path.startswith(".fingerprints/")
    assert singles[0].checkpoint_path.endswith("/L1")
    assert singles[2].checkpoint_path.endswith("/L2")
    assert (models_root / singles[0].checkpoint_path / "model.safetensors").is_file()

    assert len(profile.measurements) == 24
    first = profile.measurements[0]
    assert (first.variant_name, first.num_layers, first.full_model) == ("base", 1, False)
    assert (first.config.tensor_parallel, first.config.pipeline_parallel) == (1, 1)
    assert (first.input_tokens, first.output_tokens, first.repetitions) == (64, 4, 2)
    assert first.ttft_ms == 2.0 and first.latency_ms == 6.0 and first.hardware_type == "cpu-test"
    assert list(first.stage_layers) == [1]
    assert {
        (m.num_layers, m.config.batch_size, m.input_tokens, m.output_tokens)
        for m in profile.measurements
    } == {(n, b, p, o) for n in (1, 2) for b in (1, 2) for p in (64, 256, 1024) for o in (4, 8)}
    assert len(profile.skipped) == 2
    assert all(
        "FAILED_PRECONDITION: workers on this node run tp = pp = 1 only" in s
        for s in profile.skipped
    )
    assert profile.skipped[0].startswith("base tp=1 pp=2: base fingerprint(2 layers) tp=1 pp=2")
    assert profile.cost.wall_time_ms > 0 and profile.cost.device_seconds > 0
    assert profile.cost.peak_device_memory_bytes == (10 + 2 + 2) * MIB
    assert (progress.state, progress.runs_done) == (model_pb.MODEL_STATE_PROFILED, 12)
    assert progress.runs_total == 12


def test_a_failing_base_reference_fails_the_model(redis_url, models_root):
    def broken(request):
        return (grpc.StatusCode.FAILED_PRECONDITION, "worker rank 0 exited with code 1: boom")

    model, profile, progress, calls, owners = run_profiler(redis_url, models_root, broken)
    assert model.state == model_pb.MODEL_STATE_FAILED
    assert model.state_reason == (
        "base fingerprint(1 layer) tp=1 pp=1 batch=1: "
        "FAILED_PRECONDITION: worker rank 0 exited with code 1: boom"
    )
    assert len(calls) == 1 and owners == set() and profile is None
    assert progress.state == model_pb.MODEL_STATE_FAILED and progress.message == model.state_reason


def test_a_failure_naming_the_fingerprint_says_which_checkpoint_it_was_cut_from(
    redis_url, models_root
):
    """A worker names the directory it loaded, the fingerprint under .fingerprints/,
    which the user never wrote (a tester's NaN weights)."""

    def nan_weights(request):
        return (
            grpc.StatusCode.FAILED_PRECONDITION,
            f"worker rank 0 exited (1): cannot load {request.checkpoint_path}: tensor 'x' in "
            "model.safetensors holds NaN or infinite values",
        )

    model, *_ = run_profiler(redis_url, models_root, nan_weights)
    assert model.state == model_pb.MODEL_STATE_FAILED
    assert re.search(
        r"holds NaN or infinite values \(\.fingerprints/[0-9a-f]{32}/L1 is the 1-layer "
        r"fingerprint cut from checkpoint 'tiny'\)$",
        model.state_reason,
    ), model.state_reason


def test_an_agent_that_stops_answering_is_named_in_the_models_reason(redis_url, models_root):
    """The job's agent gone (killed mid-profiling): the reason names its node and says
    how to retry, not only gRPC's "UNAVAILABLE: Socket closed"."""
    from services.ports import free_port

    gone = f"127.0.0.1:{free_port()}"

    async def agent_gone(store, profiler):
        node = (await store.list_nodes())[0]
        node.agent_address = gone
        await store.register_node(node, ttl_s=60)

    model, *_ = run_profiler(redis_url, models_root, measured, before=agent_gone)
    assert model.state == model_pb.MODEL_STATE_FAILED
    assert model.state_reason.startswith(
        f"base fingerprint(1 layer) tp=1 pp=1 batch=1: the agent of node n0 ({gone}) "
        "stopped answering (UNAVAILABLE: "
    ), model.state_reason
    assert model.state_reason.endswith("register the model again once it is back")


def test_a_profile_an_agent_left_incomplete_says_so_in_the_models_reason(redis_url, models_root):
    """The agent gone after (1,1) was measured: the model is PROFILED on what was, and its
    reason says the profile is incomplete and how to complete it (it read as complete,
    only the profile's skipped list telling otherwise)."""

    def gone_after_one_rank(request):
        if len(request.workers) > 1:  # the fake agent has no health service: "gone"
            return (grpc.StatusCode.UNAVAILABLE, "Socket closed")
        return measured(request)

    model, profile, *_ = run_profiler(redis_url, models_root, gone_after_one_rank)
    assert model.state == model_pb.MODEL_STATE_PROFILED
    assert model.state_reason.startswith(
        "incomplete: 2 profiling job(s) failed because an agent stopped answering"
    ), model.state_reason
    assert "register the model again once the agent is back" in model.state_reason
    assert len(profile.skipped) == 2 and all("stopped answering" in s for s in profile.skipped)
    # Skipped for the cluster's shape alone, a profile is complete: no reason.
    model, *_ = run_profiler(redis_url, models_root, single_rank_only)
    assert model.state == model_pb.MODEL_STATE_PROFILED and model.state_reason == ""


def test_a_profile_a_killed_worker_left_incomplete_says_so_and_may_be_registered_again(
    redis_url, models_root
):
    """A profiling worker killed mid-job (its agent answering UNAVAILABLE): the model read
    as PROFILED and complete, only the skipped list saying a layout was missing, and
    registering it again, as a note advised, was refused (a probe)."""
    from fingerprint_svc.registry import check_retry

    killed = {
        # Once it served: the agent's stream to it broke.
        "ready": (grpc.StatusCode.UNAVAILABLE, "profiling generation failed: Stream removed"),
        # Before it was ready: the supervisor saw it die (a recheck found this one missed).
        "starting": (
            grpc.StatusCode.FAILED_PRECONDITION,
            "worker rank 0 of deployment profile-x killed by SIGKILL before it was ready",
            ((REASON_KEY, WorkerKilled.reason),),
        ),
    }
    for when, refusal in killed.items():

        def worker_killed_on_two_ranks(request, refusal=refusal):
            return refusal if len(request.workers) > 1 else measured(request)

        model, profile, *_ = run_profiler(
            redis_url, models_root, worker_killed_on_two_ranks, agent_answers_health=True
        )
        assert model.state == model_pb.MODEL_STATE_PROFILED
        assert model.state_reason.startswith(
            "incomplete: 2 profiling job(s) failed because their worker was gone"
        ), (when, model.state_reason)
        assert model.state_reason.endswith("register the model again to complete it")
        assert len(profile.skipped) == 2 and all(refusal[1] in s for s in profile.skipped)
        again = model_pb.Model(model_id=model.model_id, checkpoint_path=model.checkpoint_path)
        check_retry(model, again, profiling=False, skip_profiling=False)

    # A worker that exits of its own accord fails the same way again: complete as it is.
    def worker_fails_on_two_ranks(request):
        if len(request.workers) > 1:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                "worker rank 0 of deployment profile-x exited with code 1 before it was ready",
            )
        return measured(request)

    model, *_ = run_profiler(
        redis_url, models_root, worker_fails_on_two_ranks, agent_answers_health=True
    )
    assert model.state == model_pb.MODEL_STATE_PROFILED and not model.state_reason.startswith(
        "incomplete"
    )


def test_a_profile_other_processes_slowed_says_so_in_the_models_reason(redis_url, models_root):
    """A profile taken while other processes held the CPUs gave estimates 2-3.5x the
    measured latencies, and nothing said so. What other processes took of the devices'
    cores is kept with the measurements, and the model's reason says how many were
    slowed and what to do."""

    def slowed(request):
        runs = measured(request)
        for i, run in enumerate(runs):
            run.other_cpu_share = 0.6 if i == 0 else 0.05
        return runs

    model, profile, *_ = run_profiler(redis_url, models_root, slowed)
    assert model.state == model_pb.MODEL_STATE_PROFILED
    ratios = [m.other_cpu_share for m in profile.measurements]
    slowed_count = sum(1 for r in ratios if r > 0.25)
    assert slowed_count and 0.05 in ratios
    assert model.state_reason == (
        f"{slowed_count} of {len(ratios)} profiled measurements were taken while other "
        "processes used up to 60% of the devices' CPU cores (past 25%), even when measured "
        "again after the other jobs: estimates from them run high, and one layout against "
        "another can come out the wrong way round; on a quiet machine, delete the model "
        "(`iserve model delete`, once "
        "no deployment serves it) and register it again"
    )
    # Runs without a ratio (a GPU, a kernel that does not say): nothing is said.
    model, profile, *_ = run_profiler(redis_url, models_root, measured)
    assert model.state_reason == ""
    assert not any(m.HasField("other_cpu_share") for m in profile.measurements)


def _job_key(request: agent_pb.RunProfilingJobRequest) -> str:
    return request.config.SerializeToString().hex() + request.checkpoint_path


def test_a_job_other_processes_slowed_is_measured_again_after_the_others(redis_url, models_root):
    """A probe's one-layer fingerprint, measured while other processes held the cores,
    bent the fit (a pipeline stage came out at minus 3 ms and min-latency deployed the
    slowest layout): each job whose runs were slowed runs once more after the others,
    and the less slowed measurement is kept."""
    seen: dict[str, int] = {}

    def slowed_once(request):
        key = _job_key(request)
        seen[key] = seen.get(key, 0) + 1
        runs = measured(request)
        # The (1,1) jobs are slowed the first time only, some below the share that
        # names a profile slowed (a tester's 0.24 bent the fit all the same).
        first_at_base = seen[key] == 1 and request.config.tensor_parallel <= 1
        for run in runs:
            run.other_cpu_share = (
                (0.6 if request.config.batch_size > 1 else 0.2)
                if first_at_base and request.config.pipeline_parallel <= 1
                else 0.02
            )
        return runs

    model, profile, progress, calls, _ = run_profiler(redis_url, models_root, slowed_once)
    assert model.state == model_pb.MODEL_STATE_PROFILED
    assert model.state_reason == ""  # the slowed measurements were replaced
    assert all(m.other_cpu_share == 0.02 for m in profile.measurements)
    again = [key for key, count in seen.items() if count == 2]
    assert again and all(count <= 2 for count in seen.values())
    assert len(calls) == len(seen) + len(again)
    # The re-runs come after every first run, and the progress counts them.
    firsts = {_job_key(request) for request, _ in calls[: len(seen)]}
    assert firsts == set(seen) and {_job_key(r) for r, _ in calls[len(seen) :]} == set(again)
    assert (progress.runs_done, progress.runs_total) == (len(calls), len(calls))

    # Slowed every time: measured twice, the first kept, and the reason says so.
    def always_slowed(request):
        runs = measured(request)
        for run in runs:
            run.other_cpu_share = 0.6
        return runs

    model, profile, _, calls, _ = run_profiler(redis_url, models_root, always_slowed)
    assert len(calls) == 2 * len({_job_key(r) for r, _ in calls})
    assert model.state_reason.startswith(f"{len(profile.measurements)} of ")


def _tiny(model_id: str, path: str) -> model_pb.Model:
    return model_pb.Model(
        model_id=model_id,
        checkpoint_path=path,
        shape=model_pb.ModelShape(
            num_layers=3, num_attention_heads=4, num_kv_heads=2, intermediate_size=192,
            hidden_size=64,
        ),
    )  # fmt: skip


def test_a_checkpoint_changed_before_a_job_is_measured_again_fails_the_model(
    redis_url, models_root
):
    """The first round measured the model; it was rewritten before a slowed job ran
    again: the model ends FAILED, as in the first round, not PROFILED on a mix."""
    path = "tiny-again"
    create_checkpoint(models_root / path, **SHAPE)
    seen: set[str] = set()

    def slowed_first_round(request):
        key = _job_key(request)
        again = key in seen
        seen.add(key)
        runs = measured(request)
        for run in runs:
            run.other_cpu_share = 0.02 if again else 0.6
        return runs

    async def rewrite_when_measuring_again(store, profiler):
        progress = profiler._progress

        async def watch(model_id, done, total, current, message, *args, **kwargs):
            if message.startswith("measuring again") and (models_root / path).exists():
                import shutil

                shutil.rmtree(models_root / path)
                create_checkpoint(models_root / path, **{**SHAPE, "hidden_size": 128})
            return await progress(model_id, done, total, current, message, *args, **kwargs)

        profiler._progress = watch

    model, *_ = run_profiler(
        redis_url,
        models_root,
        slowed_first_round,
        model=_tiny("m-again", path),
        before=rewrite_when_measuring_again,
    )
    assert model.state == model_pb.MODEL_STATE_FAILED, model.state_reason
    assert "is no longer the model registered from it" in model.state_reason


@pytest.mark.parametrize("change", ["rewritten", "deleted", "truncated", "linked"])
def test_a_checkpoint_changed_mid_profiling_fails_the_model(redis_url, models_root, change):
    """The checkpoint rewritten as another model, or deleted, after the first job: the
    model ends FAILED with the reason (it ended PROFILED, in silence, on measurements
    of another model or with the rest skipped)."""
    import shutil

    path = f"tiny-{change}"
    create_checkpoint(models_root / path, **SHAPE)

    changed = []

    def change_after_first(request):
        if not changed:
            changed.append(change)
            if change == "truncated":
                weights = models_root / path / "model.safetensors"
                weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
                return measured(request)
            if change == "linked":  # its weights now a link to a file outside the root
                weights = models_root / path / "model.safetensors"
                outside = models_root.parent / f"outside-{path}.safetensors"
                weights.rename(outside)
                weights.symlink_to(outside)
                return measured(request)
            shutil.rmtree(models_root / path)
            if change == "rewritten":
                create_checkpoint(models_root / path, **{**SHAPE, "hidden_size": 128})
        return measured(request)

    model, profile, progress, calls, owners = run_profiler(
        redis_url, models_root, change_after_first, model=_tiny(f"m-{change}", path)
    )
    assert model.state == model_pb.MODEL_STATE_FAILED, model.state_reason
    assert model.state_reason.startswith("base fingerprint(1 layer) tp=1 pp=1 batch=2: ")
    if change == "rewritten":
        assert (
            f"checkpoint '{path}' is no longer the model registered from it: its checkpoint "
            "has hidden_size 128, the model has 64" in model.state_reason
        ), model.state_reason
    elif change in ("deleted", "linked"):
        assert f"checkpoint '{path}' can no longer be read (" in model.state_reason
        if change == "linked":
            assert "links outside the models root" in model.state_reason, model.state_reason
    else:
        assert f"checkpoint '{path}' no longer reads as registered: " in model.state_reason
        assert "truncated" in model.state_reason
    assert "register" in model.state_reason and "again" in model.state_reason
    assert len(calls) == 1 and owners == set() and profile is None
    assert progress.state == model_pb.MODEL_STATE_FAILED


def test_a_variant_whose_own_checkpoint_goes_is_dropped_and_named(redis_url, models_root):
    """A variant's own checkpoint deleted mid-profiling: the variant is dropped and the
    PROFILED model's reason says the profile is incomplete and why."""
    import shutil

    create_checkpoint(models_root / "tiny-own", **SHAPE)
    model = _tiny("tiny-own-v", "tiny")
    model.variants.append(
        common.CompressionVariant(
            name="int8",
            weight_quant=common.WEIGHT_QUANT_INT8,
            kv_quant=common.KV_QUANT_NONE,
            pruning=common.PRUNING_NONE,
            checkpoint_path="tiny-own",
        )
    )

    def drop_own(request):
        if request.config.variant_name == "int8":
            shutil.rmtree(models_root / "tiny-own", ignore_errors=True)
        return measured(request)

    stored, profile, *_ = run_profiler(redis_url, models_root, drop_own, devices=1, model=model)
    assert stored.state == model_pb.MODEL_STATE_PROFILED
    assert stored.state_reason.startswith(
        "incomplete: variant(s) int8 dropped because their checkpoint was rewritten or "
        "removed during profiling"
    ), stored.state_reason
    assert any(
        s.startswith("variant int8: ") and "can no longer be read" in s for s in profile.skipped
    )
    assert {m.variant_name for m in profile.measurements} == {"base", "int8"}


def test_a_node_without_a_copy_of_the_checkpoint_passes_the_jobs_to_one_with_it(
    redis_url, models_root
):
    """Nodes with models roots of their own: the fingerprints are cut under the model
    service's, and a job placed on a node that has no copy failed the whole model (a
    probe). That node is passed over for the model's other jobs."""
    from services.errors import CHECKPOINT_UNUSABLE, REASON_KEY

    def no_copy(request):
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"checkpoint_path {request.checkpoint_path!r} is not a directory",
            ((REASON_KEY, CHECKPOINT_UNUSABLE),),
        )

    model, profile, _, calls, owners = run_profiler(
        redis_url, models_root, no_copy, second_node=single_rank_only
    )
    assert model.state == model_pb.MODEL_STATE_PROFILED, model.state_reason
    assert profile.measurements and owners == set()
    # n0 (first by name, both idle) was asked once; every job ran, or was refused, on n1.
    refused = [r for r, held in calls if any("n0" in str(h) for h in held.values())]
    assert len(refused) == 1, [r.checkpoint_path for r, _ in calls]
    # With no node holding a copy, the model fails naming each node's reason.
    model, *_ = run_profiler(redis_url, models_root, no_copy, second_node=no_copy)
    assert model.state == model_pb.MODEL_STATE_FAILED
    assert "no live node has a copy of the checkpoint (node n0: INVALID_ARGUMENT" in (
        model.state_reason
    ), model.state_reason
    assert "node n1: INVALID_ARGUMENT" in model.state_reason


def test_no_device_with_room_fails_the_model_without_calling_the_agent(redis_url, models_root):
    model, profile, _, calls, owners = run_profiler(
        redis_url, models_root, measured, device_bytes=300 * MIB
    )
    assert model.state == model_pb.MODEL_STATE_FAILED
    assert "base fingerprint(1 layer) tp=1 pp=1 batch=1: no device has" in model.state_reason
    assert "largest free: 300 MiB on n0/cpu" in model.state_reason
    assert calls == [] and owners == set() and profile is None


def test_one_device_skips_the_multi_device_references(redis_url, models_root):
    model, profile, _, calls, _ = run_profiler(redis_url, models_root, measured, devices=1)
    assert model.state == model_pb.MODEL_STATE_PROFILED
    assert all(len(r.workers) == 1 for r, _ in calls) and len(calls) == 4
    assert profile.skipped == [
        "tp=1 pp=2 (every variant): needs 2 devices on one node; the largest node has 1",
        "tp=2 pp=1 (every variant): needs 2 devices on one node; the largest node has 1",
    ]


def test_a_variant_the_agent_refuses_is_skipped(redis_url, models_root):
    def no_int4(request):
        if request.config.weight_quant == common.WEIGHT_QUANT_INT4:
            return (grpc.StatusCode.FAILED_PRECONDITION, "int4 is not available")
        return measured(request)

    model = model_pb.Model(
        model_id="tiny-v",
        checkpoint_path="tiny",
        shape=model_pb.ModelShape(
            num_layers=3,
            num_attention_heads=4,
            num_kv_heads=2,
            intermediate_size=192,
            head_dim=16,
            hidden_size=64,
        ),  # fmt: skip
        variants=[
            common.CompressionVariant(
                name="int4",
                weight_quant=common.WEIGHT_QUANT_INT4,
                kv_quant=common.KV_QUANT_NONE,
                pruning=common.PRUNING_NONE,
            )
        ],
    )
    stored, profile, _, calls, _ = run_profiler(
        redis_url, models_root, no_int4, devices=1, model=model
    )
    assert stored.state == model_pb.MODEL_STATE_PROFILED
    assert {m.variant_name for m in profile.measurements} == {"base"}
    assert [c.config.variant_name for c, _ in calls] == ["", "", "", "", "int4"]
    assert profile.skipped[-1] == (
        "variant int4: int4 fingerprint(1 layer) tp=1 pp=1 batch=1 failed: "
        "FAILED_PRECONDITION: int4 is not available"
    )


def test_recovery_fails_interrupted_models_and_frees_their_memory(redis_url, models_root):
    async def interrupted(store, profiler):
        stale = model_pb.Model(model_id="stale", state=model_pb.MODEL_STATE_PROFILING)
        await store.create_model(stale)
        await store.reserve("profile-stale-0000", {("n0", "cpu0"): 600 * MIB})
        await store.reserve("some-deployment", {("n0", "cpu0"): 100 * MIB})
        await profiler.recover()
        model = await store.get_model("stale")
        assert model.state == model_pb.MODEL_STATE_FAILED
        assert "register the model again" in model.state_reason
        assert await store.reservation_owners() == {"some-deployment"}
        await store.release("some-deployment")

    model, *_ = run_profiler(redis_url, models_root, measured, devices=1, before=interrupted)
    assert model.state == model_pb.MODEL_STATE_PROFILED


def test_cancelling_releases_the_reservation(redis_url, models_root):
    async def main():
        store = StateStore.from_url(redis_url)
        await store.redis.flushdb()
        started = asyncio.Event()

        async def slow(request):
            started.set()
            await asyncio.sleep(30)
            return measured(request)

        server = grpc.aio.server()
        agent = FakeAgent(store, slow)
        agent_service_pb2_grpc.add_AgentServiceServicer_to_server(agent, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            device = common.DeviceState(
                ref=common.DeviceRef(node_id="n0", device_id="cpu0"), total_bytes=2 * GIB
            )
            await store.register_node(
                common.NodeState(node_id="n0", agent_address=f"127.0.0.1:{port}", devices=[device]),
                ttl_s=60,
            )
            settings = load_settings(
                {"ISERVE_MODELS_ROOT": str(models_root), "ISERVE_STATE_DIR": str(models_root)}
            )
            profiler = Profiler(settings, store, SETTINGS)
            model = model_pb.Model(
                model_id="tiny-c",
                checkpoint_path="tiny",
                shape=model_pb.ModelShape(
                    num_layers=3, num_attention_heads=4, num_kv_heads=2, intermediate_size=192
                ),
            )
            await store.create_model(model)
            await profiler.start(model)
            await asyncio.wait_for(started.wait(), 30)
            assert profiler.running("tiny-c")
            assert len(await store.reservation_owners()) == 1
            await profiler.cancel("tiny-c")
            assert not profiler.running("tiny-c")
            assert await store.reservation_owners() == set()
        finally:
            await server.stop(0)
            await store.close()

    asyncio.run(main())


def test_two_models_never_profile_at_once(redis_url, models_root):
    in_flight, most = [0], [0]

    async def one_at_a_time(request):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(0.02)
        in_flight[0] -= 1
        return measured(request)

    async def second_model(store, profiler):
        other = model_pb.Model(
            model_id="tiny-2",
            checkpoint_path="tiny",
            shape=model_pb.ModelShape(
                num_layers=3, num_attention_heads=4, num_kv_heads=2, intermediate_size=192
            ),
        )
        await store.create_model(other)
        await profiler.start(other)

    model, _, _, calls, _ = run_profiler(
        redis_url, models_root, one_at_a_time, devices=2, before=second_model
    )
    assert model.state == model_pb.MODEL_STATE_PROFILED
    assert len(calls) == 24 and most[0] == 1


def test_memory_an_exiting_worker_still_holds_is_waited_for(redis_url, models_root):
    """The node's monitor still counts the previous job's worker (used beyond any
    reservation) for a moment after it exits: the next job waits for it to be given back
    instead of skipping a reference as if the devices were full."""

    async def busy_for_a_second(store, profiler):
        (node,) = await store.list_nodes()
        for device in node.devices:
            device.used_bytes = device.total_bytes
        await store.publish_devices(node.node_id, node.devices, ttl_s=60)

        async def exit_worker():
            await asyncio.sleep(1.0)
            for device in node.devices:
                device.used_bytes = 0
            await store.publish_devices(node.node_id, node.devices, ttl_s=60)

        profiler._settle = asyncio.get_running_loop().create_task(exit_worker())

    model, profile, _, calls, owners = run_profiler(
        redis_url, models_root, measured, before=busy_for_a_second
    )
    assert model.state == model_pb.MODEL_STATE_PROFILED, model.state_reason
    assert list(profile.skipped) == [] and len(calls) > 0 and owners == set()


def test_devices_full_of_other_reservations_fail_at_once(redis_url, models_root):
    """Reserved room is not waited for (that job may run for minutes): the reason says so."""

    async def reserved_elsewhere(store, profiler):
        (node,) = await store.list_nodes()
        await store.reserve(
            "another-deployment",
            {(node.node_id, d.ref.device_id): d.total_bytes for d in node.devices},
        )

    started = time.monotonic()
    model, _, _, calls, _ = run_profiler(
        redis_url, models_root, measured, before=reserved_elsewhere
    )
    assert model.state == model_pb.MODEL_STATE_FAILED and "no device has" in model.state_reason
    assert time.monotonic() - started < 10 and calls == []
