"""The real worker process (``python -m monitor_agent.worker``) over gRPC."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api import common_pb2 as common
from services.api import worker_service_pb2 as worker_pb
from services.api import worker_service_pb2_grpc
from services.errors import rpc_reason
from services.models.checkpoint import create_checkpoint

MAX_SEQ_LEN = 512
PROMPT = "The river runs past the old mill"
START_TIMEOUT_S = 60
# For tests that cut a generation short: a model slow enough (about 9 ms a token on one
# core of the dev box) that SLOW_TOKENS take some 14 s, longer than any stall of the test
# between reading the first tokens and cutting the stream. The tiny checkpoint's 400
# tokens took 0.2-0.5 s, and a stall that long let the generation finish first.
SLOW_SHAPE = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4}
SLOW_MAX_SEQ_LEN = 1600
SLOW_TOKENS = 1500
# How long a cancelled generation may take to leave the worker on a busy machine.
CANCEL_WAIT_S = 30.0


def start_worker(checkpoint: Path, ready_file: Path, log_path: Path, *extra: str):
    """Start a worker on core 0; returns (process, address) once its ready file exists."""
    argv = [
        sys.executable, "-m", "monitor_agent.worker",
        "--deployment-id", "dep-test",
        "--checkpoint", str(checkpoint),
        "--max-seq-len", str(MAX_SEQ_LEN),
        "--cores", "0",
        "--ready-file", str(ready_file),
        *extra,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"worker did not start:\n{log_path.read_text()}")
        time.sleep(0.05)
    record = json.loads(ready_file.read_text())
    return proc, record


@pytest.fixture(scope="module")
def worker(checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("worker")
    proc, record = start_worker(checkpoint, run_dir / "ready.json", run_dir / "worker.log")
    assert record["pid"] == proc.pid
    assert record["resident_bytes"] > 0
    address = f"127.0.0.1:{record['port']}"
    with grpc.insecure_channel(address) as channel:
        yield proc, channel, record
    proc.terminate()
    assert proc.wait(15) == 0, (run_dir / "worker.log").read_text()


@pytest.fixture(scope="module")
def stub(worker) -> worker_service_pb2_grpc.WorkerServiceStub:
    return worker_service_pb2_grpc.WorkerServiceStub(worker[1])


def start_slow_worker(checkpoint: Path, run_dir: Path, *extra: str):
    """A worker on ``create_slow_checkpoint``'s model with room for SLOW_TOKENS."""
    return start_worker(
        checkpoint, run_dir / "ready.json", run_dir / "worker.log",
        "--max-seq-len", str(SLOW_MAX_SEQ_LEN), *extra,
    )  # fmt: skip


def create_slow_checkpoint(tmp_path_factory) -> Path:
    return create_checkpoint(tmp_path_factory.mktemp("slow_ckpt") / "slow", **SLOW_SHAPE)


@pytest.fixture(scope="module")
def slow_stub(tmp_path_factory) -> Iterator[worker_service_pb2_grpc.WorkerServiceStub]:
    checkpoint = create_slow_checkpoint(tmp_path_factory)
    run_dir = tmp_path_factory.mktemp("slow_worker")
    proc, record = start_slow_worker(checkpoint, run_dir)
    with grpc.insecure_channel(f"127.0.0.1:{record['port']}") as channel:
        yield worker_service_pb2_grpc.WorkerServiceStub(channel)
    proc.terminate()
    assert proc.wait(15) == 0, (run_dir / "worker.log").read_text()


@pytest.fixture(scope="module")
def engine(checkpoint):
    from monitor_agent.engine.engine import Engine

    return Engine(checkpoint, max_seq_len=MAX_SEQ_LEN)


def _generate(stub, **fields) -> list[worker_pb.WorkerServiceGenerateResponse]:
    request = worker_pb.WorkerServiceGenerateRequest(request_id="req", **fields)
    return list(stub.Generate(request, timeout=60))


def _stats(stub) -> worker_pb.GetWorkerStatsResponse:
    return stub.GetWorkerStats(worker_pb.GetWorkerStatsRequest(request_id="s"), timeout=10)


def test_greedy_tokens_match_the_engine_in_process(stub, engine):
    from monitor_agent.engine.engine import SamplingConfig

    prompt_ids = engine.encode(PROMPT)
    expected = list(engine.generate(prompt_ids, 24, SamplingConfig(ignore_eos=True)))
    responses = _generate(
        stub,
        prompt=PROMPT,
        max_tokens=24,
        sampling=common.SamplingParams(ignore_eos=True),
    )
    assert [r.token_ids[0] for r in responses] == [s.token_id for s in expected]
    assert all(len(r.token_ids) == 1 for r in responses)
    assert "".join(r.text for r in responses) == "".join(s.text for s in expected)

    *tokens, last = responses
    assert all(r.finish_reason == common.FINISH_REASON_UNSPECIFIED for r in tokens)
    assert not any(r.HasField("usage") or r.HasField("timings") for r in tokens)
    assert last.finish_reason == common.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == 24
    assert last.request_id == "req"
    # Alone in its step: its first token waited for its own prefill only.
    assert responses[0].prompt_tokens == responses[0].prefilled_with_tokens == len(prompt_ids)
    assert all(r.prefilled_with_tokens == 0 for r in responses[1:])
    t = last.timings
    assert 0 < t.ttft_ms <= t.total_ms
    assert t.tpot_ms > 0 and t.queue_ms >= 0


def test_token_ids_and_text_prompts_agree(stub, engine):
    by_text = _generate(stub, prompt=PROMPT, max_tokens=8)
    by_ids = _generate(stub, prompt_token_ids=engine.encode(PROMPT), max_tokens=8)
    assert [r.token_ids[0] for r in by_text] == [r.token_ids[0] for r in by_ids]


def test_a_stop_token_ends_the_stream_with_finish_reason_stop(stub):
    greedy = [r.token_ids[0] for r in _generate(stub, prompt=PROMPT, max_tokens=6)]
    stop_id = greedy[2]
    responses = _generate(
        stub,
        prompt=PROMPT,
        max_tokens=6,
        sampling=common.SamplingParams(stop_token_ids=[stop_id]),
    )
    first_stop = greedy.index(stop_id)
    assert [r.token_ids[0] for r in responses] == greedy[: first_stop + 1]
    assert responses[-1].finish_reason == common.FINISH_REASON_STOP
    assert responses[-1].usage.completion_tokens == first_stop + 1


def test_seeded_sampling_is_reproducible(stub):
    sampling = common.SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    first = _generate(stub, prompt=PROMPT, max_tokens=12, sampling=sampling)
    second = _generate(stub, prompt=PROMPT, max_tokens=12, sampling=sampling)
    assert [r.token_ids[0] for r in first] == [r.token_ids[0] for r in second]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": "", "max_tokens": 4}, "prompt is empty"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens must be at least 1"),
        (
            {"prompt_token_ids": [5] * 500, "max_tokens": 13},
            r"prompt \(500 tokens\) \+ max_tokens \(13\) exceeds max_seq_len \(512\)",
        ),
        ({"prompt_token_ids": [5, 99999], "max_tokens": 4}, "outside"),
        (
            {"prompt": PROMPT, "max_tokens": 4, "sampling": common.SamplingParams(temperature=-1)},
            "temperature",
        ),
        (
            {"prompt": PROMPT, "max_tokens": 4, "sampling": common.SamplingParams(top_p=1.5)},
            "top_p",
        ),
    ],
)
def test_bad_requests_are_invalid_arguments(stub, fields, message):
    with pytest.raises(grpc.RpcError) as caught:
        _generate(stub, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, caught.value.details())


def test_cancelling_a_stream_stops_the_generation(slow_stub):
    stub = slow_stub
    before = _stats(stub)
    call = stub.Generate(
        worker_pb.WorkerServiceGenerateRequest(
            prompt=PROMPT, max_tokens=SLOW_TOKENS, sampling=common.SamplingParams(ignore_eos=True)
        ),
        timeout=120,
    )
    for _ in range(3):
        next(call)
    assert call.cancel(), "the generation had ended before it was cancelled"
    deadline = time.monotonic() + CANCEL_WAIT_S
    while _stats(stub).active_requests != 0:
        assert time.monotonic() < deadline, "the worker kept generating after cancellation"
        time.sleep(0.02)
    after = _stats(stub)
    assert after.requests_served == before.requests_served + 1
    assert after.tokens_generated - before.tokens_generated < SLOW_TOKENS
    # The engine is free again.
    assert len(_generate(stub, prompt=PROMPT, max_tokens=3)) == 3


def test_stats_describe_the_worker(stub):
    before = _stats(stub)
    _generate(stub, prompt=PROMPT, max_tokens=5)
    after = _stats(stub)
    assert after.deployment_id == "dep-test" and after.rank == 0
    assert after.resident_bytes > 0
    assert after.peak_memory_bytes >= after.resident_bytes
    assert after.requests_served == before.requests_served + 1
    assert after.tokens_generated == before.tokens_generated + 5
    assert after.busy_seconds > before.busy_seconds
    assert after.active_requests == 0


@pytest.fixture(scope="module")
def batch_worker(checkpoint, tmp_path_factory):
    """A worker with four KV-cache slots."""
    run_dir = tmp_path_factory.mktemp("batch_worker")
    proc, record = start_worker(
        checkpoint, run_dir / "ready.json", run_dir / "worker.log", "--max-batch", "4"
    )
    with grpc.insecure_channel(f"127.0.0.1:{record['port']}") as channel:
        yield worker_service_pb2_grpc.WorkerServiceStub(channel), record
    proc.terminate()
    assert proc.wait(15) == 0, (run_dir / "worker.log").read_text()


def test_four_concurrent_streams_are_batched_and_match_single_requests(batch_worker, engine):
    from monitor_agent.engine.engine import SamplingConfig

    stub, ready = batch_worker
    prompts = [PROMPT, "A quick brown fox", "Once upon a time in a land far away", "Hi there"]
    lengths = [40, 28, 36, 32]
    expected = [
        [s.token_id for s in engine.generate(engine.encode(p), n, SamplingConfig(ignore_eos=True))]
        for p, n in zip(prompts, lengths, strict=True)
    ]

    def run(prompt: str, max_tokens: int) -> list[worker_pb.WorkerServiceGenerateResponse]:
        sampling = common.SamplingParams(ignore_eos=True)
        return _generate(stub, prompt=prompt, max_tokens=max_tokens, sampling=sampling)

    started = time.perf_counter()
    sequential = [run(p, n) for p, n in zip(prompts, lengths, strict=True)]
    sequential_s = time.perf_counter() - started
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(run, prompts, lengths))
    concurrent_s = time.perf_counter() - started
    print(
        f"\n4 streams, max_batch 4: sequential {sequential_s:.3f} s, concurrent {concurrent_s:.3f} s"
    )

    for responses, want in zip([*sequential, *concurrent], [*expected, *expected], strict=True):
        assert [r.token_ids[0] for r in responses] == want
        last = responses[-1]
        assert last.finish_reason == common.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == len(want)
        assert 0 < last.timings.ttft_ms <= last.timings.total_ms and last.timings.tpot_ms > 0
    stats = _stats(stub)
    assert stats.requests_served == 8 and stats.tokens_generated == 2 * sum(lengths)
    # resident = weights + KV cache (what the ready file said) + the measured activation peak
    assert stats.resident_bytes > ready["resident_bytes"]
    assert stats.peak_memory_bytes == stats.resident_bytes


def test_kv_quant_int8_reaches_the_engine(checkpoint, worker):
    from monitor_agent.worker.process import load_engine, parse_args

    argv = ["--deployment-id", "d", "--checkpoint", str(checkpoint), "--ready-file", "r"]
    args = parse_args([*argv, "--max-seq-len", str(MAX_SEQ_LEN), "--kv-quant", "int8"])
    engine = load_engine(args, cores=[])
    assert engine.kv_cache_dtype == "int8"
    # head_dim 16: int8 values + a 2-byte scale per 16 take 18/64 of the float32 cache
    fp32_cache = 2 * 2 * 2 * 16 * MAX_SEQ_LEN * 4  # K+V, layers, kv_heads, head_dim, seq, fp32
    saved = fp32_cache - fp32_cache * 18 // 64
    assert engine.memory.resident_bytes == worker[2]["resident_bytes"] - saved


def test_health_and_reflection_say_serving(worker):
    health = health_pb2_grpc.HealthStub(worker[1])
    for service in ("", "iserve.v1.WorkerService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rank", "1"], "--rank 1 is outside 0..0"),
        (["--tensor-parallel", "2"], "--world-size 1 must equal tp·pp = 2"),
        (["--pipeline-parallel", "2"], "--world-size 1 must equal tp·pp = 2"),
        (["--tensor-parallel", "3", "--world-size", "3"], "must be one of (1, 2, 4, 8)"),
        (["--tensor-parallel", "2", "--world-size", "2"], "--rendezvous HOST:PORT is required"),
        (["--layer-count", "1"], "select a pipeline stage; pp is 1"),
        (["--cores", "0,x"], "not a core number"),
        (["--kv-quant", "int4"], "invalid choice: 'int4'"),
    ],
)
def test_unsupported_arguments_exit_2_with_a_message(tmp_path, args, message):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "monitor_agent.worker",
            "--deployment-id",
            "d",
            "--checkpoint",
            str(tmp_path),
            "--ready-file",
            str(tmp_path / "ready.json"),
            *args,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "ready.json").exists()


def test_a_checkpoint_without_weights_exits_1_with_the_reason(tmp_path, checkpoint):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_bytes((checkpoint / name).read_bytes())
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "monitor_agent.worker",
            "--deployment-id",
            "d",
            "--checkpoint",
            str(broken),
            "--ready-file",
            str(tmp_path / "ready.json"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "no *.safetensors files" in result.stderr


def test_a_worker_whose_agent_died_stops_by_itself(tmp_path, checkpoint):
    # A stand-in agent starts the worker in its own session, as the supervisor does, then
    # exits at once without stopping it.
    launcher = (
        "import os, subprocess, sys\n"
        "argv = [sys.executable, '-m', 'monitor_agent.worker', '--deployment-id', 'orphan',\n"
        f"        '--checkpoint', {str(checkpoint)!r}, '--cores', '0',\n"
        f"        '--ready-file', {str(tmp_path / 'ready.json')!r},\n"
        "        '--parent-pid', str(os.getpid())]\n"
        "print(subprocess.Popen(argv, start_new_session=True,\n"
        "                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", launcher], capture_output=True, text=True, timeout=30, check=True
    )
    worker = psutil.Process(int(result.stdout))
    try:
        worker.wait(timeout=START_TIMEOUT_S)
    except psutil.TimeoutExpired:
        worker.kill()
        raise AssertionError("the orphaned worker kept running") from None
    assert (tmp_path / "ready.json").exists()  # it did start, and then noticed


def test_loading_a_model_imports_no_compiler_machinery(checkpoint, tmp_path):
    # torch._dynamo and sympy are over 1.5 s of a worker's start-up on a small machine;
    # building the model on the meta device and allocating it must not pull them in.
    script = (
        "import sys\n"
        "from monitor_agent.worker import process\n"
        f"args = process.parse_args(['--deployment-id', 'd', '--checkpoint', {str(checkpoint)!r},\n"
        f"                           '--ready-file', {str(tmp_path / 'ready.json')!r}])\n"
        "engine = process.load_engine(args, [], None)\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_prompt_too_long_for_any_tokenization_is_refused_without_tokenizing(stub):
    huge = "the river runs past the mill " * 400_000  # 12 MB of text
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        _generate(stub, prompt=huge, max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert details.startswith(f"prompt of {len(huge)} characters is longer than a prompt of ")
    assert " accepts at most " in details  # the deployment's limit, as every refusal says
    # The reason clients trim on, as for a prompt counted over the limit.
    assert rpc_reason(err.value) == "context_length_exceeded"
    assert time.monotonic() - start < 10  # refused by length, not after encoding it all
    assert len(_generate(stub, prompt=PROMPT, max_tokens=2)) == 2  # and the worker serves on
