"""The agent's side of profiling: job checks, timing maths, peak memory, and a job run
against a fake supervisor and a fake rank-0 WorkerService."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from monitor_agent import profiling
from monitor_agent.devices import DeviceSpec
from monitor_agent.profiling import (
    LayerCounters,
    ProfilingJobs,
    StreamTiming,
    check_job,
    peak_resident_bytes,
    prompt_token_ids,
    reset_peak_resident,
    stream_timing,
    summarise,
)
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc
from services.errors import InvalidArgument, RemoteError
from services.models.checkpoint import create_checkpoint, read_config
from services.models.families import parse_config

SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def _request(**fields) -> agent_pb.RunProfilingJobRequest:
    fields.setdefault("checkpoint_path", "tiny")
    fields.setdefault("config", common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1))
    fields.setdefault("workers", [agent_pb.WorkerSpec(rank=0, device_id="cpu0")])
    fields.setdefault("input_tokens", 8)
    fields.setdefault("output_tokens", [3, 5])
    return agent_pb.RunProfilingJobRequest(**fields)


def test_check_job_fills_defaults_and_refuses_bad_requests():
    job = check_job(_request())
    # The default settings' job, and one at the bound, pass.
    check_job(_request(input_tokens=64, extra_input_tokens=[256, 1024], output_tokens=[8, 16]))
    check_job(_request(timed_runs=100, output_tokens=[500, 500]))
    assert (job.timed_runs, job.warmup_runs, job.batch_size, job.max_seq_len) == (3, 0, 1, 13)
    for fields, message in [
        ({"input_tokens": 0}, "input_tokens"),
        ({"output_tokens": []}, "output_tokens is empty"),
        ({"output_tokens": [4, 0]}, "at least 1"),
        # Beyond the uint32 sequence length (an INTERNAL "Value out of range" before).
        ({"input_tokens": 256, "output_tokens": [1024, 2**32 - 1]}, "exceeds any sequence"),
        ({"extra_input_tokens": [0]}, "every extra_input_tokens value must be at least 1"),
        # A shorter prompt after a longer one would read the longer one's peak memory.
        ({"extra_input_tokens": [4]}, r"must ascend without repeats \(got 8, 4\)"),
        ({"extra_input_tokens": [8]}, "must ascend without repeats"),
        ({"extra_input_tokens": [16, 2**32 - 1]}, "exceeds any sequence"),
        # Work without end that held the job's devices until the caller's deadline (a
        # fuzzing tester).
        ({"timed_runs": 2**32 - 1}, "timed_runs must be at most 100"),
        ({"warmup_runs": 101}, "warmup_runs must be at most 100"),
        ({"output_tokens": list(range(1, 18))}, "output_tokens has 17 lengths"),
        ({"extra_input_tokens": list(range(9, 26))}, "extra_input_tokens has 17 lengths"),
        (
            {"config": common.DeploymentConfig(batch_size=100_000)},
            "batch_size must be at most 256",
        ),
        # Every field within its bound, the whole about 27 million decode steps (a tester).
        (
            {
                "warmup_runs": 100,
                "timed_runs": 100,
                "extra_input_tokens": list(range(16, 272, 16)),
                "output_tokens": list(range(485, 501)),
            },
            r"asks for 26792000 decode steps \(200 runs x 17 prompts x 7880 output tokens\)",
        ),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            check_job(_request(**fields))


def test_stream_timing_uses_the_token_timestamps():
    timing = stream_timing(10.0, [10.050, 10.060, 10.080], 10.081)
    assert timing.ttft_ms == pytest.approx(50.0)
    assert timing.tpot_ms == pytest.approx(15.0)
    assert timing.latency_ms == pytest.approx(81.0)
    assert stream_timing(0.0, [0.5], 0.5).tpot_ms == 0.0
    with pytest.raises(ValueError, match="no tokens"):
        stream_timing(0.0, [], 1.0)


def test_summarise_takes_medians_of_each_batch_s_last_first_token_and_mean_tpot():
    runs = [
        [StreamTiming(10, 2, 30), StreamTiming(20, 4, 50)],  # last TTFT 20, mean TPOT 3; 50
        [StreamTiming(12, 3, 40), StreamTiming(12, 3, 41)],  # 12, 3; 41
        [StreamTiming(90, 9, 99), StreamTiming(90, 9, 99)],  # an outlier the median drops
    ]
    run = summarise(16, runs, [100, 200])
    assert (run.output_tokens, run.ttft_ms, run.tpot_ms, run.latency_ms) == (16, 20, 3, 50)
    assert list(run.peak_memory_bytes_per_rank) == [100, 200]
    assert (run.ttft_layer_ms, run.tpot_layer_ms) == (0.0, 0.0)  # no layer clock read
    clocked = summarise(16, runs, [100], [(4.0, 1.0), (5.0, 0.9), (40.0, 9.0)])
    assert (clocked.ttft_layer_ms, clocked.tpot_layer_ms) == (5.0, 1.0)


def test_layer_counters_give_the_time_per_layer_pass_between_two_readings():
    before = LayerCounters(
        prefill_seconds=1.0, prefill_passes=9, decode_seconds=2.0, decode_passes=100
    )
    after = LayerCounters(
        prefill_seconds=1.027, prefill_passes=18, decode_seconds=2.05, decode_passes=200
    )
    # A stage of 10 layers, its clock timing the 9 after the first: one prefill forward
    # (a batch of one, or prefilled together).
    prefill_ms, decode_ms = after.layer_ms_since(before, layers=10)
    assert prefill_ms == pytest.approx(3.0) and decode_ms == pytest.approx(0.5)
    assert before.layer_ms_since(before, layers=10) == (0.0, 0.0)  # no passes: not measured


@pytest.mark.parametrize(("forwards", "factor"), [(1, 1.0), (2, 2.0), (4, 4.0)])
def test_prefill_forwards_one_after_another_add_up_to_the_batch_s_ttft(forwards, factor):
    """Two prompts prefilled one after another: the second's first token, the batch's
    TTFT, comes after both forwards; per forward alone, batch 2 read as costing batch
    1's prefill."""
    before = LayerCounters()
    after = LayerCounters(prefill_seconds=0.003 * forwards * 2, prefill_passes=2 * forwards)
    prefill_ms, _ = after.layer_ms_since(before, layers=3)  # 2 timed layers a forward
    assert prefill_ms == pytest.approx(3.0 * factor)
    one_layer = LayerCounters(prefill_seconds=0.003 * forwards, prefill_passes=forwards)
    assert one_layer.layer_ms_since(before, layers=1)[0] == pytest.approx(3.0 * factor)


def test_peak_resident_bytes_reads_vmhwm(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t1024 kB\n")
    assert peak_resident_bytes(42, tmp_path) == 2048 * 1024
    assert peak_resident_bytes(43, tmp_path) == 0
    if os.path.exists("/proc/self/status"):
        assert peak_resident_bytes(os.getpid()) > 1 << 20


def test_a_reset_peak_is_the_resident_set_then(tmp_path):
    """A follower's growth is measured from its resident set as the runs start: the peak
    its load set (here a child's freed 256 MiB) no longer hides anything below it."""
    assert not reset_peak_resident(42, tmp_path)  # no such process
    (tmp_path / "42").mkdir()
    assert reset_peak_resident(42, tmp_path)
    assert (tmp_path / "42" / "clear_refs").read_text() == "5"
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("no /proc/<pid>/clear_refs on this system")
    code = "b = bytearray(256 << 20); del b; print(flush=True); import sys; sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        child.stdout.readline()  # allocated and freed
        loaded = peak_resident_bytes(child.pid)
        assert loaded > 256 << 20
        if not reset_peak_resident(child.pid):
            pytest.skip("this kernel refuses to reset a child's peak resident set")
        assert peak_resident_bytes(child.pid) < loaded - (200 << 20)
    finally:
        child.stdin.close()
        child.wait(10)


def test_prompt_ids_avoid_bos_and_eos(tmp_path):
    create_checkpoint(tmp_path / "m", **SHAPE)
    spec = parse_config(read_config(tmp_path / "m"))
    ids = prompt_token_ids(64, spec)
    assert len(ids) == 64 and ids == prompt_token_ids(64, spec)
    assert not {spec.bos_token_id, *spec.eos_token_ids} & set(ids)
    assert all(0 <= t < spec.vocab_size for t in ids)


class FakeWorker(worker_service_pb2_grpc.WorkerServiceServicer):
    """Streams ``max_tokens`` tokens: the first after ``first_s``, then one per ``gap_s``."""

    def __init__(self, first_s: float, gap_s: float, fail: bool = False):
        self.first_s, self.gap_s, self.fail = first_s, gap_s, fail
        self.requests: list[worker_pb.WorkerServiceGenerateRequest] = []
        # A layer clock as a 2-layer model keeps it (the second layer of each forward,
        # clocked_layers): 3 ms per layer in a prefill, 0.5 ms per layer in a decode step.
        self.clock = {"prefill_s": 0.0, "prefill": 0, "decode_s": 0.0, "decode": 0}

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker gone")
        await asyncio.sleep(self.first_s)
        self.clock["prefill_s"] += 0.003
        self.clock["prefill"] += 1
        for i in range(request.max_tokens):
            if i:
                await asyncio.sleep(self.gap_s)
                self.clock["decode_s"] += 0.0005
                self.clock["decode"] += 1
            yield worker_pb.WorkerServiceGenerateResponse(token_ids=[7])

    async def GetWorkerStats(self, request, context):
        return worker_pb.GetWorkerStatsResponse(
            peak_memory_bytes=123_456,
            prefill_layer_seconds=self.clock["prefill_s"],
            prefill_layer_passes=self.clock["prefill"],
            decode_layer_seconds=self.clock["decode_s"],
            decode_layer_passes=self.clock["decode"],
        )


@dataclass
class FakeStore:
    deleted: list[str] = field(default_factory=list)

    async def delete_workers(self, deployment_id: str) -> None:
        self.deleted.append(deployment_id)


@dataclass
class FakeSupervisor:
    address: str
    store: FakeStore = field(default_factory=FakeStore)
    plans: list = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    # What each rank last wrote into its ready record.
    records: dict[int, dict] = field(default_factory=dict)
    # Where the workers' logs would be: none are written here (a job prunes the old ones
    # in it; a directory that does not exist holds none).
    log_dir: Path = Path("/nonexistent/iserve-fake-worker-logs")

    async def start_workers(self, plan):
        self.plans.append(plan)
        # Every rank is this process; the others report their own account of 5000 bytes.
        return [
            agent_pb.WorkerInfo(
                deployment_id=plan.deployment_id,
                rank=w.rank,
                device_id=w.device.device_id,
                address=self.address if w.rank == 0 else "",
                pid=os.getpid(),
                resident_bytes=0 if w.rank == 0 else 5000,
            )
            for w in plan.workers
        ]

    async def stop_workers(self, deployment_id: str):
        self.stopped.append(deployment_id)
        return []

    def worker_record(self, deployment_id: str, rank: int) -> dict | None:
        return self.records.get(rank)


def _run_job(
    tmp_path,
    worker: FakeWorker,
    request: agent_pb.RunProfilingJobRequest,
    cpu=lambda cores, pids: None,
    records: dict[int, dict] | None = None,
):
    """The job against ``worker``; ``cpu`` stands for the kernel's account of the
    devices' cores (by default none: the worker is this test's process); ``records``, for
    what the ranks wrote into their ready records (by default nothing beyond readiness)."""
    create_checkpoint(tmp_path / "tiny", **SHAPE, overwrite=True)
    devices = {
        f"cpu{i}": DeviceSpec(
            f"cpu{i}", common.DEVICE_KIND_CPU_VIRTUAL, "cpu", "cpu-test", 1 << 30, (i,)
        )
        for i in range(2)
    }

    async def main():
        server = grpc.aio.server()
        worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        supervisor = FakeSupervisor(f"127.0.0.1:{port}", records=records or {})
        jobs = ProfilingJobs(supervisor, devices, models_root=tmp_path, ready_timeout_s=5)
        real_reading, profiling.cpu_reading = profiling.cpu_reading, cpu
        try:
            if isinstance(request, list):  # several jobs, one after another, one agent
                return [await jobs.run(r) for r in request], supervisor
            return await jobs.run(request), supervisor
        except Exception as exc:
            return exc, supervisor
        finally:
            profiling.cpu_reading = real_reading
            await server.stop(0)

    return asyncio.run(main())


class StreamClock:
    """``time.perf_counter`` as the agent reads it on a worker that sends the first token
    ``first_s`` after a batch's call and the others ``gap_s`` apart.

    The agent reads the clock as a batch starts (its task), then times each stream (a
    task of its own) by its readings at each token and at its end. Real timestamps there
    move with the machine's load (a stall between two tokens' arrivals bunches them);
    these follow the worker's schedule: a batch starts at 0, a stream's first reading is
    ``first_s`` and each one after ``gap_s`` later (its end one gap after its last
    token)."""

    def __init__(self, first_s: float, gap_s: float) -> None:
        self.first_s, self.gap_s = first_s, gap_s
        self.readings: dict[asyncio.Task, int] = {}

    def perf_counter(self) -> float:
        task = asyncio.current_task()
        if task is None or task.get_coro().__name__ != "_stream":
            return 0.0  # a batch's start
        index = self.readings[task] = self.readings.get(task, -1) + 1
        return self.first_s + index * self.gap_s

    def __getattr__(self, name: str):  # the rest of the time module, as it is
        return getattr(time, name)


def test_a_job_times_its_streams_and_stops_its_workers(tmp_path, monkeypatch):
    # Whatever this node prefers, profiling runs the PyTorch engine, whose layer clock
    # it reads.
    monkeypatch.setenv("ISERVE_ENGINE", "tensorrt_llm")
    monkeypatch.setattr(profiling, "time", StreamClock(first_s=0.05, gap_s=0.02))
    worker = FakeWorker(first_s=0.0, gap_s=0.0)
    config = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=1, batch_size=2)
    workers = [agent_pb.WorkerSpec(rank=0, device_id="cpu0", layer_count=2)]
    runs, supervisor = _run_job(
        tmp_path,
        worker,
        _request(config=config, warmup_runs=1, timed_runs=2, workers=workers),
    )
    assert [r.output_tokens for r in runs] == [3, 5]
    for run in runs:
        assert run.ttft_ms == pytest.approx(50.0)
        assert run.tpot_ms == pytest.approx(20.0)
        assert run.latency_ms == pytest.approx(50.0 + run.output_tokens * 20.0)
        assert list(run.peak_memory_bytes_per_rank) == [123_456]
        # The worker's layer clock, read around each timed run: 3 ms a layer for each
        # of the two prompts, prefilled one after the other; the last stream's first
        # token comes after both.
        assert run.ttft_layer_ms == pytest.approx(6.0)
        assert run.tpot_layer_ms == pytest.approx(0.5)
    # 2 output lengths × (1 warm-up + 2 timed) runs × 2 concurrent streams.
    assert len(worker.requests) == 12
    first = worker.requests[0]
    assert len(first.prompt_token_ids) == 8 and first.sampling.ignore_eos
    [plan] = supervisor.plans
    assert plan.deployment_id.startswith("profile-") and plan.max_batch == 2
    assert plan.max_seq_len == 8 + 5
    assert plan.engine == "pytorch" and plan.time_layers
    assert supervisor.stopped == [plan.deployment_id] == supervisor.store.deleted


def test_a_job_runs_every_prompt_length_in_one_worker_shortest_first(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "time", StreamClock(first_s=0.05, gap_s=0.02))
    worker = FakeWorker(first_s=0.0, gap_s=0.0)
    runs, supervisor = _run_job(
        tmp_path, worker, _request(extra_input_tokens=[24], warmup_runs=0, timed_runs=1)
    )
    assert [(r.input_tokens, r.output_tokens) for r in runs] == [(8, 3), (8, 5), (24, 3), (24, 5)]
    assert [len(r.prompt_token_ids) for r in worker.requests] == [8, 8, 24, 24]
    [plan] = supervisor.plans  # one worker, its cache sized for the longest prompt
    assert plan.max_seq_len == 24 + 5


def test_other_ranks_report_their_account_plus_measured_growth(tmp_path):
    config = common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=1)
    workers = [
        agent_pb.WorkerSpec(rank=0, device_id="cpu0", tensor_rank=0),
        agent_pb.WorkerSpec(rank=1, device_id="cpu1", tensor_rank=1),
    ]
    runs, supervisor = _run_job(
        tmp_path, FakeWorker(0.0, 0.0), _request(config=config, workers=workers)
    )
    assert [w.rank for w in supervisor.plans[0].workers] == [0, 1]
    for run in runs:
        rank0, rank1 = run.peak_memory_bytes_per_rank
        # Rank 1 is this test's process: its peak RSS barely moves during the runs.
        assert rank0 == 123_456 and 5000 <= rank1 < 5000 + (64 << 20)


def test_other_ranks_that_measured_themselves_report_their_own_figure(tmp_path):
    """A follower that wrote its peak into its ready record, measured as rank 0 measures
    its own, is reported with that figure, not with its account plus RSS growth."""
    config = common.DeploymentConfig(tensor_parallel=2, pipeline_parallel=1)
    workers = [
        agent_pb.WorkerSpec(rank=0, device_id="cpu0", tensor_rank=0),
        agent_pb.WorkerSpec(rank=1, device_id="cpu1", tensor_rank=1),
    ]
    records = {1: {"port": 0, "pid": os.getpid(), "resident_bytes": 5000, "peak_memory_bytes": 777}}
    runs, _ = _run_job(
        tmp_path, FakeWorker(0.0, 0.0), _request(config=config, workers=workers), records=records
    )
    assert [list(run.peak_memory_bytes_per_rank) for run in runs] == [[123_456, 777]] * 2


def test_a_failing_job_still_stops_its_workers(tmp_path):
    error, supervisor = _run_job(tmp_path, FakeWorker(0, 0, fail=True), _request())
    assert isinstance(error, RemoteError) and error.code == grpc.StatusCode.UNAVAILABLE
    assert "profiling generation failed: worker gone" in str(error)
    assert supervisor.stopped == [supervisor.plans[0].deployment_id]


def test_a_prompt_longer_than_the_model_is_refused_before_starting(tmp_path):
    error, supervisor = _run_job(
        tmp_path, FakeWorker(0, 0), _request(input_tokens=4000, output_tokens=[16])
    )
    assert isinstance(error, InvalidArgument)
    assert "max_seq_len 4016 (the longest prompt + output" in str(error)
    assert "exceeds the model's 2048 positions (max_position_embeddings)" in str(error)
    assert supervisor.plans == [] and supervisor.stopped == []


def test_a_fingerprint_s_job_plans_its_workers_with_the_full_model_s_stage_layers(tmp_path):
    config = common.DeploymentConfig(tensor_parallel=1, pipeline_parallel=2)
    workers = [
        agent_pb.WorkerSpec(rank=0, device_id="cpu0", stage=0, first_layer=0, layer_count=1),
        agent_pb.WorkerSpec(rank=1, device_id="cpu1", stage=1, first_layer=1, layer_count=1),
    ]
    _, supervisor = _run_job(
        tmp_path, FakeWorker(0, 0), _request(config=config, workers=workers, model_layers=25)
    )
    [plan] = supervisor.plans
    assert plan.time_layers and plan.footprint_model_layers == 25
    argv = [plan.worker_argv(w, "127.0.0.1", tmp_path / "ready") for w in plan.workers]
    # The full model's 25 layers split as a deployment splits them: 13 and 12.
    assert [a[a.index("--footprint-layers") + 1] for a in argv] == ["13", "12"]


def test_model_layers_below_the_checkpoint_s_own_are_refused_before_starting(tmp_path):
    error, supervisor = _run_job(tmp_path, FakeWorker(0, 0), _request(model_layers=1))
    assert isinstance(error, InvalidArgument)
    assert "model_layers (1) is below the checkpoint's own 2 layers" in str(error)
    assert supervisor.plans == [] and supervisor.stopped == []
    # 0 (the checkpoint stands for itself) and its own count time the layers as they are.
    for layers in (0, 2):
        _, supervisor = _run_job(tmp_path, FakeWorker(0, 0), _request(model_layers=layers))
        [plan] = supervisor.plans
        argv = plan.worker_argv(plan.workers[0], "127.0.0.1", tmp_path / "ready")
        assert "--footprint-layers" not in argv


def test_a_cpu_reading_is_the_cores_busy_time_and_the_processes_own(tmp_path):
    """The cores' time not idle (ticks, as ns) and the processes' threads' CPU time."""
    from monitor_agent.profiling import _NS_PER_TICK, CpuReading, cpu_reading, other_share

    (tmp_path / "stat").write_text(
        "cpu  1 1 1 1 1 1 1 1 0 0\n"
        "cpu0 100 0 50 900 10 5 5 0 0 0\n"  # busy 160 ticks (idle, iowait left out)
        "cpu1 200 0 0 800 0 0 0 40 0 0\n"  # busy 240 (steal counts)
        "cpu2 999 0 0 0 0 0 0 0 0 0\n"
    )
    for pid, threads in ((10, {"10": "300 50 7", "11": "100 30 2"}), (20, {"20": "600 20 1"})):
        for tid, line in threads.items():
            (tmp_path / str(pid) / "task" / tid).mkdir(parents=True)
            (tmp_path / str(pid) / "task" / tid / "schedstat").write_text(line + "\n")
    reading = cpu_reading([0, 1], [10, 20], tmp_path)
    assert (reading.busy_ns, reading.own_ns) == (400 * _NS_PER_TICK, 1000)
    assert cpu_reading([0, 7], [10], tmp_path) is None  # no such core
    assert cpu_reading([0], [10, 30], tmp_path) is None  # a process gone
    assert cpu_reading([], [10], tmp_path) is None
    # Over 1 s on 2 cores: 1.5 s busy, 0.5 s of it the stack's own: a half for others.
    before, after = CpuReading(0, 0, 0), CpuReading(10**9, 15 * 10**8, 5 * 10**8)
    assert other_share(before, after, 2) == pytest.approx(0.5)
    assert other_share(before, CpuReading(10**9, 10**8, 5 * 10**8), 2) == 0.0  # own elsewhere
    assert other_share(before, CpuReading(0, 1, 1), 2) is None  # no time passed
    assert other_share(None, after, 2) is None
    # This machine's kernel, where it keeps per-task scheduler statistics (a kernel
    # without them gives None, and profiling takes every run as it is).
    if Path(f"/proc/{os.getpid()}/schedstat").exists():
        mine = cpu_reading(sorted(os.sched_getaffinity(0))[:1], [os.getpid()])
        assert mine is not None and mine.own_ns > 0


def test_runs_other_processes_slowed_are_taken_again_and_the_least_slowed_kept(tmp_path):
    """A profile taken while other processes held the CPUs ran 2-3.5x slow, and every
    estimate from it with it. Runs during which other processes used more than the
    contended share of the devices' cores are run again (up to 2x the timed runs); the
    runs they took least from are kept, and the measurement carries their share."""
    from monitor_agent.profiling import CpuReading

    # Per run, the share the readings will show, for 4 measurements (prompts 8 and 24,
    # outputs 3 and 5): 2 slowed runs, then quiet ones; every run slowed, even taken
    # again (so the next is not); slowed, not taken again; quiet (so again after it).
    script = iter(
        [0.9, 0.7, 0.05, 0.1, 0.08]
        + [0.6, 0.9, 0.7, 0.55, 0.8, 0.65]
        + [0.7, 0.6, 0.9]
        + [0.05, 0.1, 0.15]
    )
    readings = {"at": 0, "busy": 0, "next": None}

    def reading(cores, pids):
        assert cores == [0] and os.getpid() in pids  # the device's core; the agent's own
        if readings["next"] is None:  # before a run: the share it will show
            readings["next"] = next(script)
        else:  # after it: 1 s later, the scripted share of the core busy with others
            readings["at"] += 10**9
            readings["busy"] += int(readings["next"] * 10**9)
            readings["next"] = None
        return CpuReading(readings["at"], readings["busy"], 0)

    worker = FakeWorker(first_s=0.0, gap_s=0.0)
    runs, _ = _run_job(
        tmp_path,
        worker,
        _request(warmup_runs=0, timed_runs=3, extra_input_tokens=[24]),
        cpu=reading,
    )
    shares = [r.other_cpu_share for r in runs]
    # 0.05, 0.1, 0.08 kept; 0.55, 0.6, 0.65 of the 6; the 3; the 3.
    assert shares == pytest.approx([0.08, 0.6, 0.7, 0.1])
    assert len(worker.requests) == 5 + 6 + 3 + 3
    # Where the kernel says nothing (the default here), 3 runs and no share.
    runs, _ = _run_job(tmp_path, FakeWorker(0.0, 0.0), _request(timed_runs=3))
    assert not any(r.HasField("other_cpu_share") for r in runs)


def test_a_load_that_lasts_is_not_run_against_again_in_the_next_job(tmp_path):
    """A model's jobs follow each other: after a measurement that got too few quiet runs
    even when taken again, the next job's runs are not taken again either (in CI, where
    every profile is slowed, each job's first measurement doubled its runs), until a
    measurement's runs are all quiet."""
    from monitor_agent.profiling import CpuReading

    # Job 1 (outputs 3, 5): 6 slowed runs, then 3 (not taken again). Job 2: 3 slowed
    # runs, not taken again; then 3 quiet ones. Job 3: 2 slowed, then quiet: taken again.
    script = iter([0.9] * 6 + [0.8] * 3 + [0.7] * 3 + [0.1] * 3 + [0.9, 0.9] + [0.1] * 6)
    readings = {"at": 0, "busy": 0, "next": None}

    def reading(cores, pids):
        if readings["next"] is None:
            readings["next"] = next(script)
        else:
            readings["at"] += 10**9
            readings["busy"] += int(readings["next"] * 10**9)
            readings["next"] = None
        return CpuReading(readings["at"], readings["busy"], 0)

    worker = FakeWorker(first_s=0.0, gap_s=0.0)
    request = _request(warmup_runs=0, timed_runs=3)
    jobs, _ = _run_job(tmp_path, worker, [request] * 3, cpu=reading)
    assert [[r.other_cpu_share for r in runs] for runs in jobs] == [
        pytest.approx([0.9, 0.8]),
        pytest.approx([0.7, 0.1]),
        pytest.approx([0.1, 0.1]),
    ]
    assert len(worker.requests) == (6 + 3) + (3 + 3) + (5 + 3)


def test_only_the_newest_profiling_job_logs_are_kept(tmp_path):
    """Each job left its workers' logs for good: 65 after two registrations (a tester)."""
    import os

    from monitor_agent.profiling import prune_job_logs

    jobs = [tmp_path / f"worker-profile-{i:03d}-r0.log" for i in range(10)]
    others = [tmp_path / "agent.log", tmp_path / "worker-demo-1a2b-r0.log"]
    for age, path in enumerate(reversed([*jobs, *others])):
        path.write_text("x")
        os.utime(path, ns=(10**18 - age * 10**9, 10**18 - age * 10**9))  # jobs[-1] newest
    jobs.append(tmp_path / "worker-profile-009-r0.log.1")
    jobs[-1].write_text("a worker's earlier log")
    os.utime(jobs[-1], ns=(1, 1))  # the oldest of all
    removed = prune_job_logs(tmp_path, keep=4)
    assert sorted(removed) == sorted([*jobs[:6], jobs[-1]])
    assert sorted(tmp_path.iterdir()) == sorted([*jobs[6:10], *others])
    assert prune_job_logs(tmp_path, keep=4) == []
