"""The engine on CUDA: one GPU against the CPU, and tensor/pipeline parallelism over NCCL
against one GPU. Skipped without CUDA (see conftest.py); the multi-GPU test also needs
two GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from monitor_agent.engine.engine import Engine
from monitor_agent.engine.loader import load_model
from services.models.checkpoint import create_checkpoint
from tests.parity.harness import randomize_weights
from tests.unit.parallel_harness import MAX_SEQ_LEN, launch, scenario, wait_all

pytestmark = pytest.mark.gpu

SHAPE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4}
CHECKPOINTS = {
    "llama-gqa": {"arch": "llama", "num_kv_heads": 2},
    "falcon-mqa": {"arch": "falcon", "num_kv_heads": 1},
}
IDS = [1, 17, 230, 5, 99, 412, 8, 77, 300, 2, 150, 61]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    out = []
    for name, shape in CHECKPOINTS.items():
        directory = tmp_path_factory.mktemp(name) / "ckpt"
        create_checkpoint(directory, seed=21, **SHAPE, **shape)
        randomize_weights(directory, seed=22)
        out.append(directory)
    return out


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """TF32 would make GPU float32 matmuls differ from the CPU's well beyond rounding."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def _logits(checkpoint: Path, device: str) -> torch.Tensor:
    model = load_model(checkpoint, device=device)
    model.setup_caches(1, MAX_SEQ_LEN)
    ids = torch.tensor([IDS], device=device)
    positions = torch.arange(len(IDS), device=device).unsqueeze(0)
    with torch.inference_mode():
        return model(ids, positions, torch.tensor([0], device=device)).float().cpu()


def test_one_gpu_computes_the_cpu_logits(checkpoints) -> None:
    for checkpoint in checkpoints:
        torch.testing.assert_close(
            _logits(checkpoint, "cuda:0"), _logits(checkpoint, "cpu"), atol=1e-4, rtol=1e-4
        )


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_tensor_and_pipeline_parallel_on_two_gpus_match_one(checkpoints, tmp_path) -> None:
    configs = {"tp2": (2, 1, ((0, 4),)), "pp2": (1, 2, ((0, 2), (2, 2)))}
    runs = {}
    for name, (tp, pp, layers) in configs.items():  # one at a time: each uses both GPUs
        out = tmp_path / name
        runs[name] = (launch(name, tp, pp, layers, checkpoints, out, "cuda"), out)
        wait_all({name: runs[name]}, 240)
    for index, checkpoint in enumerate(checkpoints):
        expected = scenario(
            Engine(checkpoint, max_seq_len=MAX_SEQ_LEN, max_batch=3, device="cuda:0")
        )
        for name, (_, out) in runs.items():
            got = json.loads((out / f"{index}.json").read_text())
            assert got == expected, f"{checkpoint.parent.name} under {name}"
