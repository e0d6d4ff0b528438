"""Shared fixtures. ``stack`` starts the real thing once per test session: a real
redis-server, every service and a node agent as processes on free ports, through the
same launcher ``iserve up`` uses."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.api import (
    agent_service_pb2_grpc,
    deployment_service_pb2_grpc,
    inference_service_pb2_grpc,
    model_service_pb2_grpc,
)
from services.cli import stack as launcher
from services.settings import Settings
from services.state.store import StateStore

DEVICE_MEMORY_GIB = 2.0
QUEUE_CAPACITY = 2


@dataclass
class Stack:
    settings: Settings
    env: dict[str, str]
    redis_url: str
    models: model_service_pb2_grpc.ModelServiceStub
    deployments: deployment_service_pb2_grpc.DeploymentServiceStub
    inference: inference_service_pb2_grpc.InferenceServiceStub
    agent: agent_service_pb2_grpc.AgentServiceStub

    @property
    def models_root(self) -> Path:
        return self.settings.models_root

    def store(self) -> StateStore:
        """A fresh async store (use inside one event loop, then close it)."""
        return StateStore.from_url(self.redis_url)


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("iserve-state")) as running:
        yield running


@contextlib.contextmanager
def running_stack(
    state_dir: Path, log: Callable[[str], None] = lambda _msg: None, **extra_env: str
) -> Iterator[Stack]:
    """A whole stack (2 devices, the test sizes) in ``state_dir``, with a client per
    service; stopped on exit. ``log`` gets what ``iserve up`` would print; ``extra_env``
    are more ``ISERVE_*`` variables."""
    env = {
        "ISERVE_DEVICES": "2",
        "ISERVE_DEVICE_MEMORY_GIB": str(DEVICE_MEMORY_GIB),
        "ISERVE_QUEUE_CAPACITY": str(QUEUE_CAPACITY),
        "ISERVE_READY_TIMEOUT_S": "90",
        "ISERVE_HEARTBEAT_TTL_S": "5",
        **extra_env,
    }
    with launcher.temporary_stack(env, state_dir=state_dir, log=log) as settings:
        channels = {
            name: grpc.insecure_channel(settings.address(name)) for name in settings.addresses
        }
        try:
            yield Stack(
                settings=settings,
                env={
                    **{k: v for k, v in os.environ.items() if k.startswith("ISERVE_")},
                    "REDIS_URL": settings.redis_url,
                },
                redis_url=settings.redis_url,
                models=model_service_pb2_grpc.ModelServiceStub(channels["model"]),
                deployments=deployment_service_pb2_grpc.DeploymentServiceStub(channels["deploy"]),
                inference=inference_service_pb2_grpc.InferenceServiceStub(channels["scheduler"]),
                agent=agent_service_pb2_grpc.AgentServiceStub(channels["agent"]),
            )
        finally:
            for ch in channels.values():
                ch.close()
