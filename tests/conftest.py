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

from services import transport
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


# How long processes the tests started may take to exit once the session is over.
LEFT_BEHIND_GRACE_S = 15.0


def processes_under(root: Path) -> dict[int, str]:
    """Live processes other than this one that run in ``root`` or were given a state or
    models directory under it (a test's redis-server, service, agent or worker): pid ->
    command line. Empty without procfs."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            environ = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if state == "Z" or "from multiprocessing." in command:
            # Exited, waiting to be reaped; or this interpreter's own multiprocessing
            # helper (resource tracker, forkserver), which ends with it.
            continue
        dirs = [
            v.split(b"=", 1)[1].decode(errors="replace")
            for v in environ
            if v.startswith((b"ISERVE_STATE_DIR=", b"ISERVE_MODELS_ROOT="))
        ]
        if any(Path(d).is_relative_to(root) for d in (cwd, *dirs) if d.startswith("/")):
            found[pid] = command.strip()
    return found


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running(tmp_path_factory) -> Iterator[None]:
    """After the whole session (torn down last, after every stack), no process the tests
    started is left: a stack's embedded Redis restarted by a test outlived the run
    before. What is left fails the session, and is killed."""
    yield
    import signal
    import time

    root = tmp_path_factory.getbasetemp().resolve()
    deadline = time.monotonic() + LEFT_BEHIND_GRACE_S
    while (left := processes_under(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes the tests started are still running: {left}"


@pytest.fixture(autouse=True)
def own_transport() -> Iterator[None]:
    """Each test starts with the transport a client reads from the environment: one that
    runs the CLI or a server's start in this process configures the process's transport,
    which a later test's stack (its TLS, its token) would otherwise inherit."""
    yield
    transport.configure(None)


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
