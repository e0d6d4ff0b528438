"""Shared fixtures. ``stack`` starts the real thing once per test session: a real
redis-server, every service and a node agent as processes on free ports, through the
same launcher ``iserve up`` uses."""

from __future__ import annotations

import os
from collections.abc import Iterator
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
from services.redis_embedded import free_port
from services.settings import SERVICE_ENV, Settings, load_settings
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
    state_dir = tmp_path_factory.mktemp("iserve-state")
    env = {
        "ISERVE_STATE_DIR": str(state_dir),
        "ISERVE_MODELS_ROOT": str(state_dir / "models"),
        "ISERVE_DEVICES": "2",
        "ISERVE_DEVICE_MEMORY_GIB": str(DEVICE_MEMORY_GIB),
        "ISERVE_QUEUE_CAPACITY": str(QUEUE_CAPACITY),
        "ISERVE_READY_TIMEOUT_S": "90",
        "ISERVE_HEARTBEAT_TTL_S": "5",
        **{var: f"127.0.0.1:{free_port()}" for var in SERVICE_ENV.values()},
    }
    saved = {k: os.environ.get(k) for k in [*env, "REDIS_URL"]}
    os.environ.pop("REDIS_URL", None)
    os.environ.update(env)
    settings = load_settings()
    info = launcher.up(settings, launcher.UpOptions(), log=lambda _msg: None)
    channels = {name: grpc.insecure_channel(settings.address(name)) for name in settings.addresses}
    try:
        yield Stack(
            settings=settings,
            env={**env, "REDIS_URL": info["redis_url"]},
            redis_url=info["redis_url"],
            models=model_service_pb2_grpc.ModelServiceStub(channels["model"]),
            deployments=deployment_service_pb2_grpc.DeploymentServiceStub(channels["deploy"]),
            inference=inference_service_pb2_grpc.InferenceServiceStub(channels["scheduler"]),
            agent=agent_service_pb2_grpc.AgentServiceStub(channels["agent"]),
        )
    finally:
        for ch in channels.values():
            ch.close()
        launcher.down(settings, log=lambda _msg: None)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
