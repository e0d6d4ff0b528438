"""``iserve status``: which services answer, and what the cluster holds."""

from __future__ import annotations

import sys
import time

import grpc
from google.protobuf import json_format

from services import transport
from services.api import deployment_service_pb2 as deploy_pb
from services.api import (
    deployment_service_pb2_grpc,
    inference_service_pb2_grpc,
    model_service_pb2_grpc,
)
from services.api import inference_service_pb2 as inference_pb
from services.api import model_service_pb2 as model_pb
from services.cli.output import TableSpec, show_tables
from services.cli.stack import RESTART_ADVICE, exited_processes, log_of
from services.health import check, http_ok, speaks_tls
from services.settings import (
    GATEWAY_ENV,
    SERVICE_ENV,
    Settings,
    read_stack_file,
    redacted_url,
)

MIB = 1 << 20


def collect_status(settings: Settings) -> dict:
    """Health of every service plus nodes, devices, models and deployments (when the
    services answer). ``healthy`` is True only when every service is SERVING; the agent at
    this host's address may be missing while the cluster has a live node (a control-plane
    host runs no agent)."""
    services = {
        name: {
            "address": address,
            "metrics": settings.metrics_url(name),
            "serving": check(address, timeout_s=2.0),
        }
        for name, address in settings.addresses.items()
    }
    gateway = settings.gateway_address
    services["gateway"] = {
        "address": f"http://{gateway}/v1",
        "metrics": f"http://{gateway}/metrics",
        "serving": http_ok(f"http://{gateway}/health"),
    }
    down = [v["address"] for k, v in services.items() if k != "gateway" and not v["serving"]]
    if down and settings.tls is None and speaks_tls(down[0]):
        # A plaintext client's health check against a stack serving TLS: the server
        # closes the connection, which reads as DOWN, metrics URLs as http://.
        status_error = (
            f"{down[0]} answers only TLS: this client has no ISERVE_TLS_* set; set "
            "ISERVE_TLS_CA (and, with mutual TLS, ISERVE_TLS_CERT, ISERVE_TLS_KEY and "
            "ISERVE_TLS_CLIENT_AUTH=on) as the stack's processes have them"
        )
    else:
        status_error = None
    status: dict = {
        "healthy": all(s["serving"] for s in services.values()),
        "state_dir": str(settings.state_dir),
        # The running stack's (ISERVE_MODELS_ROOT as `iserve up` read it), not this CLI's.
        "models_root": read_stack_file(settings.state_dir).get(
            "models_root", str(settings.models_root)
        ),
        "redis_url": redacted_url(settings.redis_url) if settings.redis_url else None,
        "addresses": dict(settings.addresses),
        "services": services,
        "nodes": [],
        "deployments": [],
        "models": [],
        # What a serving service could not tell (Redis down, say): the rest still shows.
        "errors": [status_error] if status_error else [],
        # What the caller's role may not read (its token's), said, not an error.
        "not_shown": [],
        "hints": [],
    }
    options = {"preserving_proto_field_name": True, "always_print_fields_with_no_presence": True}
    for name, what in (("deploy", "nodes, devices and deployments"), ("model", "models")):
        if not services[name]["serving"] and status_error is None:
            status["errors"].append(
                f"{name}: not answering at {services[name]['address']}: its {what} are not shown"
            )
    state = _asked(
        settings,
        status,
        "deploy",
        "cluster state",
        lambda ch: deployment_service_pb2_grpc.DeploymentServiceStub(ch).GetClusterState(
            deploy_pb.GetClusterStateRequest(), timeout=5
        ),
    )
    if state is not None:
        status["nodes"] = [json_format.MessageToDict(n, **options) for n in state.nodes]
        status["deployments"] = [json_format.MessageToDict(d, **options) for d in state.deployments]
    served = _asked(
        settings,
        status,
        "scheduler",
        "serving stats",
        lambda ch: inference_service_pb2_grpc.InferenceServiceStub(ch).GetServingStats(
            inference_pb.GetServingStatsRequest(), timeout=5
        ),
    )
    if served is not None:
        by_id = {s.deployment_id: s for s in served.deployments}
        for deployment in status["deployments"]:
            stats = by_id.get(deployment["deployment_id"], inference_pb.DeploymentServingStats())
            deployment["serving"] = json_format.MessageToDict(stats, **options)
    models = _asked(
        settings,
        status,
        "model",
        "models",
        lambda ch: model_service_pb2_grpc.ModelServiceStub(ch).ListModels(
            model_pb.ListModelsRequest(), timeout=5
        ),
    )
    if models is not None:
        status["models"] = [json_format.MessageToDict(m, **options) for m in models.models]
    agent = services["agent"]
    live = [n["node_id"] for n in status["nodes"] if n.get("alive")]
    if not agent["serving"] and live:
        # Agents are one per node, each reached at the address it records; the address
        # configured here is only this host's, and a control-plane host runs none. The
        # cluster's live nodes answer for them.
        agent["live_nodes"] = live
        status["healthy"] = not status["errors"] and all(
            s["serving"] for name, s in services.items() if name != "agent"
        )
    status["hints"] += _hints(settings, services) + _node_hints(status["nodes"])
    return status


def _node_hints(nodes: list[dict]) -> list[str]:
    """Each unreachable node's whole reason, where its cell shows it cut."""
    return [
        f"node {n['node_id']}'s agent at {n.get('agent_address') or '?'} does not answer "
        f"the deployer: {n['unreachable']}"
        for n in nodes
        if not n.get("alive")
        and n.get("unreachable")
        and short_reason(n["unreachable"]) != n["unreachable"]
    ]


def _hints(settings: Settings, services: dict) -> list[str]:
    """What to do about the services that do not answer, from the stack recorded in the
    state directory: it showed DOWN and no more, where `iserve up` said which exited and
    where its log is (a probe)."""
    down = [name for name, s in services.items() if not s["serving"] and not s.get("live_nodes")]
    recorded = read_stack_file(settings.state_dir)
    if not recorded.get("pids"):
        if len(down) < len(services):
            return []  # a stack started elsewhere, or by hand: nothing here to tell
        return [
            f"no stack is recorded in {settings.state_dir}: `iserve up` starts one; for a "
            "stack started elsewhere, set ISERVE_STATE_DIR to its state directory, or "
            "ISERVE_*_ADDR to its addresses"
        ]
    exited = exited_processes(settings.state_dir, recorded)
    gone = {
        name: log
        for name, log in exited.items()
        if name in down or name == "redis"  # the services answer on without their Redis
    }
    # One line for them all, as `iserve up` says it: the same advice once per process
    # was seven lines after a SIGKILL of the whole stack (a tester).
    hints = (
        [f"{', '.join(gone)} exited (see {', '.join(map(str, gone.values()))}): {RESTART_ADVICE}"]
        if gone
        else []
    )
    for name in down:
        if name in exited or name not in recorded["pids"]:
            continue
        asked = settings.gateway_address if name == "gateway" else settings.address(name)
        kept = (
            recorded.get("gateway_address")
            if name == "gateway"
            else recorded.get("addresses", {}).get(name)
        )
        if kept and kept != asked:
            variable = GATEWAY_ENV if name == "gateway" else SERVICE_ENV[name]
            hints.append(
                f"{name}: the stack recorded in {settings.state_dir} serves it at {kept}, "
                f"not at {asked} (set {variable} as `iserve up` had it, or unset it)"
            )
            continue
        hints.append(
            f"{name} runs (pid {recorded['pids'][name]}) but does not answer at "
            f"{services[name]['address']}: starting, stopped (kill -STOP) or stuck; see "
            f"{log_of(settings.state_dir, name)}"
        )
    return hints


def _asked(settings: Settings, status: dict, service: str, what: str, call):
    """``call(channel)``'s reply from ``service`` when it serves; None when it does not,
    or when its call fails (the error recorded in ``status``, which is then unhealthy)."""
    if not status["services"][service]["serving"]:
        return None
    with transport.sync_channel(settings.address(service)) as channel:
        try:
            return call(channel)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                # What this token's role may not read (a model developer's serving stats):
                # left out, and the stack no less healthy for it (it exited 1 for that role).
                status["not_shown"].append(f"{service}: {what}: {exc.details()}")
                return None
            status["errors"].append(f"{service}: {what}: {exc.code().name}: {exc.details()}")
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                status["hints"].append(_unimplemented_hint(settings, service, what))
            status["healthy"] = False
            return None


def _unimplemented_hint(settings: Settings, service: str, what: str) -> str:
    """Why ``service`` lacks a call: another service at the address this CLI was given
    (the stack recorded another), else an iserve older than this CLI (an upgrade's first
    status)."""
    asked = settings.address(service)
    kept = read_stack_file(settings.state_dir).get("addresses", {}).get(service)
    if kept and kept != asked:
        variable = f"ISERVE_{service.upper()}_ADDR"
        return (
            f"{service} at {asked} has no {what} call, and the stack in "
            f"{settings.state_dir} recorded {service} at {kept}: {variable} names another "
            "service"
        )
    return (
        f"{service} at {asked} has no {what} call: it is an older iserve than this one; "
        "`iserve down` (with this iserve), then `iserve up` runs this version on the same "
        "state"
    )


def _dead(node: dict) -> str:
    """ " (dead, last seen <UTC time>)" for a node whose agent stopped heartbeating;
    " (stopped on purpose at <UTC time>)" for one whose agent stopped cleanly; " (unreachable:
    why)" for one whose agent heartbeats but did not answer the deployer."""
    if node.get("alive"):
        return ""
    if node.get("unreachable"):
        return f" (unreachable: {short_reason(node['unreachable'])})"
    stopped_ms = int(node.get("stopped_at_unix_ms") or 0)
    if stopped_ms:  # its agent stopped cleanly: a planned stop, not a lost node
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(stopped_ms / 1000))
        return f" (stopped on purpose at {when} UTC)"
    last_ms = int(node.get("heartbeat_at_unix_ms") or 0)
    if not last_ms:
        return " (dead)"
    return (
        f" (dead, last seen {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(last_ms / 1000))} UTC)"
    )


# A reason longer than this is cut in a table's cell (whole in the hints and in --json).
CELL_REASON_CHARS = 48


def short_reason(reason: str) -> str:
    """``reason`` fit for a table's cell: gRPC's "failed to connect to all addresses;
    last error: UNKNOWN: ipv4:10.0.0.5:50065: Failed to connect to remote host:
    Connection refused" filled the NODE column (a probe). The last clause, which says
    what happened, is kept."""
    if len(reason) <= CELL_REASON_CHARS:
        return reason
    last = reason.rstrip().rpartition(": ")[2].strip()
    if not last or len(last) > CELL_REASON_CHARS - 1:
        last = reason[: CELL_REASON_CHARS - 1]
        return f"{last}…"
    return f"…{last}"


def status_tables(status: dict, *, watching: bool = False) -> list[TableSpec]:
    """The tables ``iserve status`` shows: services, devices, models, deployments; with
    ``watching`` (``--watch`` on a terminal, redrawn in place and cut at its height),
    deployments first, then devices, services and models: on a 24-line terminal the
    deployments, what one watches, were cut off below the rest (a probe)."""
    services = [
        [name, svc["address"], _service_state(svc), svc["metrics"]]
        for name, svc in status["services"].items()
    ]
    tables: list[TableSpec] = [(None, ["SERVICE", "ADDRESS", "STATE", "METRICS"], services)]
    devices = [
        [
            node["node_id"] + _dead(node),
            dev["ref"]["device_id"],
            dev["kind"].removeprefix("DEVICE_KIND_").lower(),
            f"{int(dev['total_bytes']) / MIB:.0f}",
            # A node that stopped heartbeating measures nothing: its last figures were
            # shown as in use now, though its workers had exited (a tester).
            "-" if silent else f"{int(dev['used_bytes']) / MIB:.0f}",
            f"{int(dev['reserved_bytes']) / MIB:.0f}",
            f"{int(dev['free_bytes']) / MIB:.0f}",
            "-" if silent else f"{float(dev['load']):.2f}",
            ",".join(dev.get("deployment_ids", [])) or "-",
        ]
        for node in status["nodes"]
        for silent in [not node.get("alive") and not node.get("unreachable")]
        for dev in node.get("devices", [])
    ]
    if devices:
        headers = ["NODE", "DEVICE", "KIND", "TOTAL MiB", "USED MiB", "RESERVED MiB"]
        tables.append((None, [*headers, "FREE MiB", "LOAD", "DEPLOYMENTS"], devices))
    if status["models"]:
        rows = [
            [
                m["model_id"],
                m.get("shape", {}).get("num_layers", ""),
                m.get("shape", {}).get("hidden_size", ""),
                m["state"].removeprefix("MODEL_STATE_"),
                m["checkpoint_path"],
            ]
            for m in status["models"]
        ]
        tables.append((None, ["MODEL", "LAYERS", "HIDDEN", "STATE", "CHECKPOINT"], rows))
    if status["deployments"]:
        rows = [
            [
                d["deployment_id"],
                d["model_id"],
                d.get("config", {}).get("tensor_parallel", ""),
                d.get("config", {}).get("pipeline_parallel", ""),
                d.get("config", {}).get("batch_size", ""),
                d["state"].removeprefix("DEPLOYMENT_STATE_"),
                _workers(d),
                *_serving_columns(d.get("serving")),
            ]
            for d in status["deployments"]
        ]
        headers = ["DEPLOYMENT", "MODEL", "TP", "PP", "BATCH", "STATE", "WORKER"]
        tables.append((None, [*headers, "QUEUE", "RUNNING", "TTFT P50/P95 ms", "SLO MET"], rows))
    if watching:
        order = ("DEPLOYMENT", "NODE", "SERVICE", "MODEL")
        tables.sort(key=lambda table: order.index(table[1][0]))
    return tables


# What `status --watch` leaves out of a table too wide for the terminal, first to last:
# the figures that stay put (addresses, sizes, layouts) before the ones watched change.
WATCH_OPTIONAL = (
    "WORKER", "CHECKPOINT", "METRICS", "ADDRESS", "KIND", "TOTAL MiB", "RESERVED MiB",
    "USED MiB", "DEPLOYMENTS", "HIDDEN", "LAYERS", "BATCH", "PP", "TP", "MODEL",
)  # fmt: skip


def _service_state(service: dict) -> str:
    if service["serving"]:
        return "serving"
    live = service.get("live_nodes")
    if live:
        return f"none here; live on {', '.join(live)}"
    return "DOWN"


def status_header(status: dict) -> str:
    return f"state dir {status['state_dir']}   redis {status['redis_url'] or '(none)'}"


def print_status(status: dict) -> None:
    print(status_header(status))
    show_tables(status_tables(status))
    for error in status.get("errors", []):
        # On stderr, as every command's errors (the README's rule); the tables on stdout.
        print(f"error: {error}", file=sys.stderr)
    for hint in status.get("hints", []):
        print(f"hint: {hint}", file=sys.stderr)
    for left_out in status.get("not_shown", []):
        print(f"note: not shown to this token: {left_out}", file=sys.stderr)


def _workers(deployment: dict) -> str:
    """The rank-0 worker address, or each replica's with its state when there are more."""
    replicas = deployment.get("replicas", [])
    if len(replicas) <= 1:
        return deployment.get("worker_address") or "-"
    return ", ".join(
        f"{r.get('worker_address') or '-'} ({r['state'].removeprefix('DEPLOYMENT_STATE_').lower()})"
        for r in replicas
    )


def _serving_columns(serving: dict | None) -> list[str]:
    """QUEUE, RUNNING, TTFT P50/P95 and SLO MET of a deployment ("-" when unknown)."""
    if serving is None:
        return ["-", "-", "-", "-"]
    ttft = "-"
    if int(serving["requests_completed"]):
        ttft = f"{serving['ttft_p50_ms']:.1f}/{serving['ttft_p95_ms']:.1f}"
    attained, missed = int(serving["slo_attained"]), int(serving["slo_missed"])
    slo = (
        f"{100 * attained / (attained + missed):.1f}% of {attained + missed}"
        if attained + missed
        else "-"
    )
    return [str(serving["requests_waiting"]), str(serving["requests_running"]), ttft, slo]
