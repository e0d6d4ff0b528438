"""The whole stack on a machine with NVIDIA GPUs: the agent finds them through NVML and
publishes their measured use, a deployment runs its worker on a GPU in the checkpoint's
dtype and streams, and a profiling job measures fingerprints there. Skipped without CUDA
(see conftest.py)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from monitor_agent.devices import hardware_slug
from services.api import agent_service_pb2 as agent_pb
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import model_service_pb2 as model_pb
from services.reservation import layer_weight_bytes
from tests.conftest import running_stack
from tests.integration.helpers import (
    cli,
    deploy,
    generate,
    make_checkpoint,
    register,
    reserved_by_device,
    rid,
    settled_devices,
    wait_for,
)

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

SHAPE = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}
MIB = 1 << 20


@pytest.fixture(scope="module")
def gpu_stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("gpu-stack")) as running:
        yield running


def _cuda0(stack) -> common.DeviceState:
    [device] = [d for d in settled_devices(stack) if d.ref.device_id == "cuda0"]
    return device


def test_the_agent_registers_every_gpu_as_nvml_describes_it(gpu_stack) -> None:
    devices = settled_devices(gpu_stack)
    assert [d.ref.device_id for d in devices] == [
        f"cuda{i}" for i in range(torch.cuda.device_count())
    ]
    for index, device in enumerate(devices):
        props = torch.cuda.get_device_properties(index)
        assert device.kind == common.DEVICE_KIND_CUDA
        assert device.hardware_type == hardware_slug(props.name)
        # NVML's total and the CUDA runtime's differ by what the driver keeps back.
        assert abs(device.total_bytes - props.total_memory) <= 0.05 * props.total_memory
        assert 0 < device.used_bytes < device.total_bytes
    shown = cli(gpu_stack, "status")
    assert shown.returncode == 0, shown.stderr
    assert "cuda0" in shown.stdout


def test_a_deployment_serves_from_the_gpu_in_the_checkpoints_dtype(gpu_stack) -> None:
    path = make_checkpoint(gpu_stack, "gpu-llama", dtype="bfloat16", **SHAPE)
    model = register(gpu_stack, "gpu-llama", path)
    idle = _cuda0(gpu_stack).used_bytes
    before = reserved_by_device(gpu_stack)

    dep = deploy(gpu_stack, "gpu-llama", max_output_tokens=32).deployment
    try:
        assert dep.state == deploy_pb.DEPLOYMENT_STATE_READY
        [stage] = dep.placement.stages
        assert [d.device_id for d in stage.devices] == ["cuda0"]
        # CUDA serves a checkpoint in its own dtype (engine_rules.default_dtype).
        assert dep.config.dtype == common.PRECISION_BFLOAT16
        [worker] = gpu_stack.agent.ListWorkers(
            agent_pb.ListWorkersRequest(deployment_id=dep.deployment_id)
        ).workers
        assert worker.state == agent_pb.WORKER_STATE_READY
        # NVML sees the worker: its CUDA context and the weights at least.
        assert wait_for(
            lambda: _cuda0(gpu_stack).used_bytes >= idle + model.shape.weight_bytes, timeout=20
        )

        deltas, final = generate(
            gpu_stack,
            deployment_id=dep.deployment_id,
            prompt="The quick brown fox",
            max_tokens=16,
            sampling=common.SamplingParams(ignore_eos=True),
        )
        assert sum(len(d.token_ids) for d in deltas) == 16
        assert final.finish_reason == common.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 16
        assert 0 < final.timings.ttft_ms < final.timings.total_ms
    finally:
        gpu_stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
        )
    assert reserved_by_device(gpu_stack) == before
    assert wait_for(lambda: not os.path.exists(f"/proc/{worker.pid}"), timeout=15)
    # The worker's memory went with it.
    assert wait_for(lambda: _cuda0(gpu_stack).used_bytes <= idle + 64 * MIB, timeout=20)
    gpu_stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id="gpu-llama"))


def test_profiling_measures_fingerprints_on_the_gpu(gpu_stack) -> None:
    path = make_checkpoint(gpu_stack, "gpu-profiled", dtype="bfloat16", **SHAPE)
    before = reserved_by_device(gpu_stack)
    model = gpu_stack.models.RegisterModel(
        model_pb.RegisterModelRequest(
            request_id=rid(), model_id="gpu-profiled", checkpoint_path=path
        )
    ).model
    events = list(
        gpu_stack.models.WatchModel(
            model_pb.WatchModelRequest(request_id=rid(), model_id="gpu-profiled"), timeout=600
        )
    )
    assert events[-1].state == model_pb.MODEL_STATE_PROFILED, events[-1]
    profile = gpu_stack.models.GetProfile(model_pb.GetProfileRequest(model_id="gpu-profiled"))
    devices = settled_devices(gpu_stack)
    hardware = devices[0].hardware_type
    assert profile.measurements
    for m in profile.measurements:
        assert m.hardware_type == hardware
        assert m.config.tensor_parallel * m.config.pipeline_parallel <= len(devices)
        # Profiled in the checkpoint's dtype, as CUDA serves it, and recorded so.
        assert m.config.dtype == common.PRECISION_BFLOAT16
        assert m.layer_weight_bytes == pytest.approx(layer_weight_bytes(model.shape, m.config))
        assert 0 < m.ttft_ms < m.latency_ms and m.tpot_ms > 0
        assert m.ttft_layer_ms > 0 and m.tpot_layer_ms > 0
        # Measured on the device: at least the fingerprint's weights.
        assert m.peak_memory_bytes_per_rank[0] > 0
    assert profile.cost.device_seconds > 0
    assert reserved_by_device(gpu_stack) == before
    # No profiling worker outlives its job.
    assert wait_for(
        lambda: not gpu_stack.agent.ListWorkers(agent_pb.ListWorkersRequest()).workers, timeout=15
    )


@pytest.mark.parametrize(
    "weight_quant, kv_quant",
    [
        (common.WEIGHT_QUANT_INT8, common.KV_QUANT_NONE),
        (common.WEIGHT_QUANT_INT4, common.KV_QUANT_INT8),
    ],
)
def test_compressed_deployments_stream_concurrently_from_the_gpu(
    gpu_stack, weight_quant, kv_quant
) -> None:
    name = f"gpu-q{weight_quant}-{kv_quant}"
    path = make_checkpoint(gpu_stack, name, dtype="bfloat16", **SHAPE)
    register(gpu_stack, name, path)
    before = reserved_by_device(gpu_stack)
    config = common.DeploymentConfig(weight_quant=weight_quant, kv_quant=kv_quant)
    dep = deploy(gpu_stack, name, max_output_tokens=16, config=config).deployment
    try:
        assert dep.state == deploy_pb.DEPLOYMENT_STATE_READY
        assert [d.device_id for d in dep.placement.stages[0].devices] == ["cuda0"]
        prompts = ["The quick brown fox", "Once upon a time", "In a hole in the ground"]
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(
                pool.map(
                    lambda prompt: generate(
                        gpu_stack,
                        deployment_id=dep.deployment_id,
                        prompt=prompt,
                        max_tokens=12,
                        sampling=common.SamplingParams(ignore_eos=True),
                    ),
                    prompts,
                )
            )
        for deltas, final in replies:
            assert sum(len(d.token_ids) for d in deltas) == 12
            assert final.finish_reason == common.FINISH_REASON_LENGTH
    finally:
        gpu_stack.deployments.RemoveDeployment(
            deploy_pb.RemoveDeploymentRequest(deployment_id=dep.deployment_id)
        )
    assert reserved_by_device(gpu_stack) == before
    gpu_stack.models.DeleteModel(model_pb.DeleteModelRequest(model_id=name))
