from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.state import keys
from tests.integration.helpers import (
    cli,
    deploy,
    forget_models,
    make_checkpoint,
    register,
    rid,
    with_store,
)
from tests.unit.estimator_data import shared_data

A6000 = "rtx-a6000"

# Big enough that a long generation lasts seconds on 2 cores (queue and cancel tests).
SERVED_SHAPE = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}
SERVED_MAX_OUTPUT = 1500


@dataclass(frozen=True)
class Served:
    model_id: str
    deployment_id: str
    request_id: str
    worker_address: str
    max_output_tokens: int


@pytest.fixture(scope="session")
def served(stack) -> Served:
    """One READY deployment shared by tests that only read from it."""
    register(stack, "served-llama", make_checkpoint(stack, "served-llama", **SERVED_SHAPE))
    request_id = rid()
    dep = deploy(
        stack, "served-llama", request_id=request_id, max_output_tokens=SERVED_MAX_OUTPUT
    ).deployment
    return Served(
        "served-llama", dep.deployment_id, request_id, dep.worker_address, SERVED_MAX_OUTPUT
    )


async def _forget_calibration(store) -> None:
    await store.redis.delete(keys.calibration(A6000))
    await store.redis.srem(keys.calibration_index(), A6000)


@pytest.fixture(scope="session")
def imported(stack) -> list[str]:
    """The A6000 data imported through `iserve profile import`; removed afterwards."""
    directory = shared_data()
    if not (directory / "fingerprint_data_collection.csv").is_file():
        pytest.skip(f"MaverIQ A6000 data not found under {directory}")
    files = [str(p) for p in sorted(directory.iterdir()) if p.is_file()]
    out = cli(stack, "profile", "import", "--format", "maveriq", "--hardware", A6000, *files)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("imported 4500 measurements on rtx-a6000 into 6 models:"), first
    assert "skipped full_model_data_collection_pruning.csv" in out.stdout
    model_ids = ["falcon-40b", "falcon-7b", "gptj-6b", "llama-2-13b", "llama-2-70b", "llama-2-7b"]
    yield model_ids
    forget_models(stack, model_ids, A6000)
    with_store(stack, _forget_calibration)
