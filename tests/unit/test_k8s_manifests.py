"""deploy/k8s: every manifest validated against the Kubernetes API's JSON schemas, offline.

kubernetes-validate (a dev extra) carries the OpenAPI-derived schemas of each Kubernetes
minor version inside its wheel, so nothing is fetched at test time. Validation is strict:
unknown fields fail, as ``kubectl apply --validate=strict`` would. A document whose kind
has no schema fails here too (the tool itself only warns). When ``kubectl`` is on PATH
the kustomization is also rendered (``kubectl kustomize``) and its output validated.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (dev extra) is not installed"
)
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "k8s"
K8S = DEPLOY / "base"
KUSTOMIZATION = K8S / "kustomization.yaml"
HOSTNETWORK = DEPLOY / "hostnetwork"
# The oldest release these manifests target (native gRPC probes are GA since 1.27) and the
# newest the installed schemas know.
VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
CONTROL_PLANE = {
    "model": 50061,
    "estimator": 50062,
    "deploy": 50063,
    "scheduler": 50064,
}


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p != KUSTOMIZATION)


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def validation_errors(doc: dict) -> list[str]:
    """Why ``doc`` is not a valid object of its kind in each of VERSIONS (none: valid)."""
    errors = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            errors.append(f"{version}: {where}: {exc.message}")
        except kubernetes_validate.utils.SchemaNotFoundError as exc:
            errors.append(f"{version}: {exc.message}")
    return errors


def all_objects() -> dict[tuple[str, str], dict]:
    objects = {}
    for path in manifest_files():
        for doc in documents(path):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# ---- schema validation ---------------------------------------------------------------------
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_is_valid(path):
    docs = documents(path)
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        errors = validation_errors(doc)
        assert not errors, f"{path.name} {doc['kind']}/{doc['metadata']['name']}: {errors}"


def _deployment() -> dict:
    return copy.deepcopy(all_objects()[("Deployment", "scheduler")])


def _wrong_type(doc):
    containers(doc)[0]["ports"][0]["containerPort"] = "fifty thousand"


def _unknown_field(doc):
    containers(doc)[0]["readinesProbe"] = containers(doc)[0].pop("readinessProbe")


def _missing_required(doc):
    del containers(doc)[0]["name"]


def _bad_probe(doc):
    containers(doc)[0]["readinessProbe"]["grpc"] = {"service": "x"}  # no port


def _unknown_kind(doc):
    doc["kind"] = "Deploymnet"


@pytest.mark.parametrize(
    "breakage",
    [_wrong_type, _unknown_field, _missing_required, _bad_probe, _unknown_kind],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_broken_manifest_fails(breakage):
    doc = _deployment()
    assert not validation_errors(doc)
    breakage(doc)
    assert validation_errors(doc), f"{breakage.__name__} was accepted"


def test_a_broken_file_fails_the_command_line_tool(tmp_path):
    """The same check as CI users run it: the tool's exit status on a broken file."""
    doc = _deployment()
    _wrong_type(doc)
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(doc))
    tool = shutil.which("kubernetes-validate") or str(
        Path(__import__("sys").executable).parent / "kubernetes-validate"
    )
    if not Path(tool).exists():
        pytest.skip("kubernetes-validate's command is not installed")
    good = subprocess.run(
        [tool, "--strict", "--quiet", str(K8S / "scheduler.yaml")], capture_output=True, text=True
    )
    bad = subprocess.run([tool, "--strict", "--quiet", str(broken)], capture_output=True, text=True)
    assert good.returncode == 0, good.stdout + good.stderr
    assert bad.returncode != 0 and "containerPort" in bad.stdout


# ---- the kustomization ---------------------------------------------------------------------
def test_kustomization_lists_every_manifest_but_the_secret_example():
    listed = yaml.safe_load(KUSTOMIZATION.read_text())["resources"]
    assert all((K8S / name).is_file() for name in listed), listed
    expected = {p.name for p in manifest_files()} - {"secret.example.yaml"}
    assert set(listed) == expected
    assert yaml.safe_load(KUSTOMIZATION.read_text())["namespace"] == "iserve"


def test_top_level_kustomization_applies_the_base():
    top = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert top["resources"] == ["base"]
    overlay = yaml.safe_load((HOSTNETWORK / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../base"]
    files = [patch for patch in overlay["patches"] if "path" in patch]
    for patch in files:
        (doc,) = documents(HOSTNETWORK / patch["path"])
        assert (doc["kind"], doc["metadata"]["name"]) == ("DaemonSet", "agent")
        assert doc["spec"]["template"]["spec"]["hostNetwork"] is True
    # The other patch deletes Redis's NetworkPolicy (see test_rendered_kustomization_is_valid).
    (inline,) = [patch for patch in overlay["patches"] if "path" not in patch]
    assert inline["target"] == {"kind": "NetworkPolicy", "name": "redis"}
    assert "$patch: delete" in inline["patch"]


def _kustomize(folder: Path) -> list[dict]:
    reply = subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert reply.returncode == 0, reply.stderr
    return [d for d in yaml.safe_load_all(reply.stdout) if d]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) not on PATH")
@pytest.mark.parametrize("folder", [DEPLOY, HOSTNETWORK], ids=["base", "hostnetwork"])
def test_rendered_kustomization_is_valid(folder):
    rendered = _kustomize(folder)
    # All but the two Secrets of the example; the host-network variant drops Redis's
    # NetworkPolicy, whose pod selector would shut out agents on the nodes' network.
    policies = {d["metadata"]["name"] for d in rendered if d["kind"] == "NetworkPolicy"}
    assert policies == (set() if folder == HOSTNETWORK else {"redis"})
    assert len(rendered) == len(all_objects()) - 2 - (folder == HOSTNETWORK)
    for doc in rendered:
        assert not validation_errors(doc), (doc["kind"], doc["metadata"]["name"])
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "iserve"
    agent = next(d for d in rendered if d["kind"] == "DaemonSet")
    spec = agent["spec"]["template"]["spec"]
    assert spec.get("hostNetwork", False) is (folder == HOSTNETWORK)
    if folder == HOSTNETWORK:
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        # The patch keeps the agent's environment, and sets no NCCL_SOCKET_IFNAME: the
        # agent picks the interface holding the node's address, which a list of
        # interfaces to leave out overrode, missing some (a tester).
        names = {e["name"] for e in spec["containers"][0]["env"]}
        assert {"ISERVE_NODE_ID", "ISERVE_AGENT_ADDR", "ISERVE_HOST"} <= names
        assert "NCCL_SOCKET_IFNAME" not in names


# ---- what the manifests hold ---------------------------------------------------------------
def test_redis_is_a_persistent_append_only_statefulset():
    redis = all_objects()[("StatefulSet", "redis")]
    args = containers(redis)[0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    # Full, it refuses writes rather than being OOM-killed at its limit (an AOF rewrite's
    # fork counts twice), and never evicts iserve's records.
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    gib = int(args[args.index("--maxmemory") + 1].removesuffix("gb"))
    limit = containers(redis)[0]["resources"]["limits"]["memory"]
    assert 2 * gib <= int(limit.removesuffix("Gi"))
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in containers(redis)[0]["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/data"
    assert redis["spec"]["serviceName"] in {
        name for kind, name in all_objects() if kind == "Service"
    }


def test_the_services_that_write_no_file_run_as_the_images_user():
    objects = all_objects()
    for name in ("estimator", "deploy", "scheduler", "gateway"):
        context = containers(objects[("Deployment", name)])[0]["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001, name
        # PodSecurity "restricted" (a tester): no capability, the runtime's seccomp profile.
        assert context["capabilities"] == {"drop": ["ALL"]}, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
    # The model service writes fingerprints into the models volume; the agent drives GPUs.
    assert "runAsUser" not in containers(objects[("Deployment", "model")])[0]["securityContext"]


def test_redis_requires_the_password_of_its_secret():
    """Passwordless, Redis was guarded by a NetworkPolicy alone, which the host-network
    variant deletes: any pod of the cluster could make itself admin."""
    objects = all_objects()
    container = containers(objects[("StatefulSet", "redis")])[0]
    args, env = container["args"], env_of(container)
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    for name in ("REDIS_PASSWORD", "REDISCLI_AUTH"):  # the server's, and the probe's
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("iserve-redis", "password")
    # $(VAR) expands only to variables defined in the container.
    assert set(objects[("Secret", "iserve-redis")]["stringData"]) == {"password"}
    assert container["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    # The same password in the URL iserve's processes read.
    url = objects[("Secret", "iserve-tokens")]["stringData"]["REDIS_URL"]
    assert url.startswith(
        f"redis://:{objects[('Secret', 'iserve-redis')]['stringData']['password']}@"
    )


@pytest.mark.parametrize(("name", "port"), CONTROL_PLANE.items())
def test_each_service_probes_its_grpc_health(name, port):
    objects = all_objects()
    deployment = objects[("Deployment", name)]
    (container,) = containers(deployment)
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, probe
    env = env_of(container)
    assert env[f"ISERVE_{name.upper()}_ADDR"]["value"] == f"0.0.0.0:{port}"
    assert container["image"].startswith("iserve-control-plane")
    service = objects[("Service", name)]
    assert {p["port"] for p in service["spec"]["ports"]} >= {port}


def test_the_gateway_is_ready_on_ready_and_alive_on_health():
    """Readiness follows the scheduler (GET /ready); liveness only the process, so a
    scheduler restart takes the gateway out of the Service without restarting it."""
    from gateway_svc.app import create_app

    routes = {route.path for route in create_app(lambda: None).routes}
    (container,) = containers(all_objects()[("Deployment", "gateway")])
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert env_of(container)["ISERVE_GATEWAY_ADDR"]["value"] == f"0.0.0.0:{port}"
    probes = {name: container[name]["httpGet"] for name in ("readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == "/health"
    for probe in probes.values():
        assert probe["path"] in routes
        assert probe["port"] == "http"


@pytest.mark.parametrize("name", ["gateway", "scheduler"])
def test_the_front_services_serve_on_until_their_endpoints_are_gone(name):
    """A gateway stops listening at SIGTERM, while kube-proxy and ingresses route new
    connections to it for some seconds more: every rollout refused connections."""
    deployment = all_objects()[("Deployment", name)]
    (container,) = containers(deployment)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and int(command[1]) >= 5
    config = all_objects()[("ConfigMap", "iserve-config")]["data"]
    drain = float(config["ISERVE_DRAIN_TIMEOUT_S"])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert int(command[1]) + drain < grace


def test_the_deployer_gets_its_drain_and_the_rollbacks_of_what_it_cuts_off():
    from deploy_svc.servicer import CUT_OFF_ROLLBACK_S

    deployment = all_objects()[("Deployment", "deploy")]
    config = all_objects()[("ConfigMap", "iserve-config")]["data"]
    drain = float(config["ISERVE_DRAIN_TIMEOUT_S"])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert drain + CUT_OFF_ROLLBACK_S < grace


def test_agent_is_a_daemonset_on_gpu_nodes():
    agent = all_objects()[("DaemonSet", "agent")]
    spec = agent["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (container,) = spec["containers"]
    assert container["image"].startswith("iserve-agent")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = env_of(container)
    assert env["ISERVE_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["ISERVE_AGENT_ADDR"]["value"] == "$(POD_IP):50065"
    # $(VAR) expands only to variables defined earlier in the list.
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("ISERVE_AGENT_ADDR")
    assert names.index("POD_IP") < names.index("ISERVE_HOST")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 50065
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}["/dev/shm"]
    assert spec.get("hostIPC") or volumes[shm]["emptyDir"]["medium"] == "Memory"


def test_every_iserve_process_has_the_settings_and_tokens():
    objects = all_objects()
    config = objects[("ConfigMap", "iserve-config")]["data"]
    assert config["ISERVE_AUTH"] == "on"
    # Redis's URL holds its password: in the Secret, not the ConfigMap.
    assert "REDIS_URL" not in config
    secret = objects[("Secret", "iserve-tokens")]
    assert set(secret["stringData"]) == {"ISERVE_ADMIN_TOKEN", "ISERVE_SERVICE_TOKEN", "REDIS_URL"}
    assert secret["stringData"]["REDIS_URL"].endswith("@redis:6379/0")
    for (kind, name), obj in objects.items():
        if kind not in ("Deployment", "DaemonSet"):
            continue
        container = containers(obj)[0]
        sources = container["envFrom"]
        assert {"configMapRef": {"name": "iserve-config"}} in sources, name
        if name != "gateway":
            assert {"secretRef": {"name": "iserve-tokens"}} in sources, name
            continue
        # The gateway reaches neither Redis nor needs the admin token
        # (WITHHELD_FROM_GATEWAY): of the Secret, the service token alone (a tester).
        assert not any("secretRef" in source for source in sources)
        env = env_of(container)
        assert env["ISERVE_SERVICE_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "iserve-tokens",
            "key": "ISERVE_SERVICE_TOKEN",
        }
        assert not {"REDIS_URL", "ISERVE_ADMIN_TOKEN"} & set(env)


def test_the_agent_s_workers_are_reaped_by_the_pod_s_init():
    """compose runs an init; here nothing did, and the agent as PID 1 reaps no worker
    orphaned to it (a tester)."""
    spec = all_objects()[("DaemonSet", "agent")]["spec"]["template"]["spec"]
    assert spec["shareProcessNamespace"] is True


def test_secret_example_placeholders_are_refused_by_iserve():
    from services.settings import load_settings

    tokens = all_objects()[("Secret", "iserve-tokens")]["stringData"]
    with pytest.raises(ValueError, match="ISERVE_"):
        load_settings({"ISERVE_AUTH": "on", "ISERVE_STATE_DIR": "/nonexistent", **tokens})


def test_services_select_their_pods_and_ports_exist():
    objects = all_objects()
    workloads = [
        o for (k, _), o in objects.items() if k in ("Deployment", "StatefulSet", "DaemonSet")
    ]
    for (kind, name), service in objects.items():
        if kind != "Service":
            continue
        selector = service["spec"]["selector"]
        matches = [
            w
            for w in workloads
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matches) == 1, f"Service {name} selects {len(matches)} workloads"
        named = {p["name"] for c in containers(matches[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert isinstance(target, int) or target in named, (name, target)
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        # The Redis NetworkPolicy admits pods by this label.
        assert labels.get("app.kubernetes.io/part-of") == "iserve"


def test_models_volume_is_shared_and_written_only_by_the_model_service():
    objects = all_objects()
    assert "ReadWriteMany" in objects[("PersistentVolumeClaim", "models")]["spec"]["accessModes"]
    for name, writes in (("model", True), ("gateway", False)):
        mounts = {
            m["name"]: m for m in containers(objects[("Deployment", name)])[0]["volumeMounts"]
        }
        assert mounts["models"].get("readOnly", False) is not writes, name
    agent_mounts = {
        m["name"]: m for m in containers(objects[("DaemonSet", "agent")])[0]["volumeMounts"]
    }
    assert agent_mounts["models"]["readOnly"] is True
