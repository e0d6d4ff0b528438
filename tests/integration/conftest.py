from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.integration.helpers import deploy, make_checkpoint, register, rid

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
