"""``iserve deploy``: its flags, the request they make and how a decision is printed.

``build_parser`` in ``services/cli/main.py`` adds the flags with :func:`add_arguments`;
``cmd_deploy`` there sends the request (:func:`request_target`) and prints the reply
(:func:`print_decision`, :func:`describe_config`).
"""

from __future__ import annotations

import argparse
import math
import sys
import uuid
from collections.abc import Callable

import grpc

from services import replicas
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.cli.arguments import positive_number, usage_error, whole_number

PRECISIONS = {
    "float32": common.PRECISION_FLOAT32,
    "bfloat16": common.PRECISION_BFLOAT16,
    "float16": common.PRECISION_FLOAT16,  # GPUs only: the deployer refuses it on CPUs
}
WEIGHT_QUANTS = {
    "none": common.WEIGHT_QUANT_NONE,
    "int8": common.WEIGHT_QUANT_INT8,
    "int4": common.WEIGHT_QUANT_INT4,
}
KV_QUANTS = {"none": common.KV_QUANT_NONE, "int8": common.KV_QUANT_INT8}
PRUNINGS = {
    "none": common.PRUNING_NONE,
    "2:4": common.PRUNING_SEMI_STRUCTURED_2_4,
    "structured": common.PRUNING_STRUCTURED,
}

# `iserve register --variant NAME:KEY=VALUE,...`: each key's CompressionVariant field and
# its values by name (None: a number).
VARIANT_KEYS: dict[str, tuple[str, dict[str, int] | None]] = {
    "weights": ("weight_quant", WEIGHT_QUANTS),
    "kv": ("kv_quant", KV_QUANTS),
    "pruning": ("pruning", PRUNINGS),
    "fraction": ("structured_prune_fraction", None),
    "accuracy": ("accuracy_score", None),
}


def variant_argument(text: str) -> common.CompressionVariant:
    """An argparse ``type`` for `iserve register --variant`:
    ``NAME:weights=int8|int4,kv=int8,pruning=2:4|structured,fraction=F,accuracy=A``
    (every key optional: none of that compression) as a CompressionVariant; what the
    values mean together (a fraction only with structured pruning, a name not "base")
    the model service checks."""
    keys = ", ".join(VARIANT_KEYS)
    name, sep, rest = text.partition(":")
    if not name or not sep:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give NAME:KEY=VALUE,... with keys {keys} "
            "(e.g. int8-kv8:weights=int8,kv=int8)"
        )
    # A key left out means none of that compression (the service wants each set).
    variant = common.CompressionVariant(
        name=name,
        weight_quant=common.WEIGHT_QUANT_NONE,
        kv_quant=common.KV_QUANT_NONE,
        pruning=common.PRUNING_NONE,
    )
    items = [part.strip() for part in rest.split(",") if part.strip()]
    if not items:
        raise argparse.ArgumentTypeError(
            f"variant {name!r} names no compression (keys {keys}): it would be the model itself"
        )
    given: set[str] = set()
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in VARIANT_KEYS:
            raise argparse.ArgumentTypeError(
                f"variant {name!r}: {item!r} is not KEY=VALUE with a key of {keys}"
            )
        if key in given:
            raise argparse.ArgumentTypeError(f"variant {name!r}: {key} is given twice")
        given.add(key)
        field, choices = VARIANT_KEYS[key]
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(
                f"variant {name!r}: {key} must be one of {', '.join(choices)}, got {value!r}"
            )
        setattr(
            variant, field, choices[value] if choices is not None else _finite(name, key, value)
        )
    return variant


def _finite(name: str, key: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"variant {name!r}: {key} must be a number, got {value!r}")
    return number


INTENTS = {
    "min-cost": common.INTENT_KIND_MIN_COST,
    "min-latency": common.INTENT_KIND_MIN_LATENCY,
    "min-memory": common.INTENT_KIND_MIN_MEMORY,
    "min-device-hours": common.INTENT_KIND_MIN_DEVICE_HOURS,
    "latency-slo": common.INTENT_KIND_LATENCY_SLO,
    "cost-slo": common.INTENT_KIND_COST_SLO,
    "max-throughput": common.INTENT_KIND_MAX_THROUGHPUT,
}
COST_FORMULAS = {
    "memory-latency": common.COST_FORMULA_MEMORY_TIMES_LATENCY,
    "memory": common.COST_FORMULA_MEMORY,
    "device-hours": common.COST_FORMULA_DEVICE_HOURS,
}
POLICIES = {
    "hybrid": common.PLACEMENT_POLICY_HYBRID,
    "packing": common.PLACEMENT_POLICY_PACKING,
    "least-loaded": common.PLACEMENT_POLICY_LEAST_LOADED,
}
SCHEDULING = {"fcfs": common.SCHEDULING_POLICY_FCFS, "edf": common.SCHEDULING_POLICY_EDF}
# The intents that rank by cost, and so take a cost formula (--cost).
COSTED = (common.INTENT_KIND_MIN_COST, common.INTENT_KIND_COST_SLO, common.INTENT_KIND_LATENCY_SLO)
EXPLICIT_FLAGS = ("tp", "pp", "dtype", "weight_quant", "kv_quant", "pruning", "variant")


def request_target(args) -> dict:
    """The DeployRequest fields that say what to deploy: an explicit configuration when
    any configuration flag is given, else the intent (min-cost by default)."""
    explicit = [f"--{f.replace('_', '-')}" for f in EXPLICIT_FLAGS if getattr(args, f)]
    intent_flags = [
        flag
        for flag, given in (
            ("--intent", args.intent),
            ("--slo-ms", args.slo_ms is not None),
            ("--budget", args.budget is not None),
            ("--min-accuracy", args.min_accuracy is not None),
            ("--cost", args.cost),
        )
        if given
    ]
    if explicit and intent_flags:
        usage_error(
            f"iserve deploy: {', '.join(explicit)} and {', '.join(intent_flags)} do not mix; "
            "give an explicit configuration or an intent"
        )
    if explicit:
        return {
            "config": common.DeploymentConfig(
                tensor_parallel=args.tp or 1,
                pipeline_parallel=args.pp or 1,
                variant_name=args.variant or "",
                dtype=PRECISIONS.get(args.dtype, 0),
                # Unset (0) where the flag is not given: the variant's, else none (the
                # deployer's default). "none" for an absent flag contradicted every
                # compressed variant named with --variant alone.
                weight_quant=WEIGHT_QUANTS[args.weight_quant] if args.weight_quant else 0,
                kv_quant=KV_QUANTS[args.kv_quant] if args.kv_quant else 0,
                pruning=PRUNINGS[args.pruning] if args.pruning else 0,
            )
        }
    name = args.intent or "min-cost"
    kind = INTENTS[name]
    if kind == common.INTENT_KIND_LATENCY_SLO and args.slo_ms is None:
        usage_error("iserve deploy: --intent latency-slo needs --slo-ms")
    if kind == common.INTENT_KIND_COST_SLO and args.budget is None:
        usage_error("iserve deploy: --intent cost-slo needs --budget")
    # A flag the intent does not use would be ignored in silence: say so instead.
    if args.slo_ms is not None and kind != common.INTENT_KIND_LATENCY_SLO:
        usage_error(f"iserve deploy: --slo-ms goes with --intent latency-slo, not {name}")
    if args.budget is not None and kind != common.INTENT_KIND_COST_SLO:
        usage_error(f"iserve deploy: --budget goes with --intent cost-slo, not {name}")
    if args.cost and kind not in COSTED:
        usage_error(
            f"iserve deploy: --cost goes with --intent min-cost, cost-slo or latency-slo "
            f"(what they rank by), not {name}"
        )
    return {"intent": intent_for(kind, args, "iserve deploy")}


def intent_for(kind: int, args, command: str) -> common.Intent:
    """The Intent of ``kind`` with what ``args`` give for it: its target (--slo-ms,
    --budget) and cost formula (--cost) where ``kind`` uses them, the accuracy floor
    (--min-accuracy, --best-available) always. ``command`` names the command in a usage
    error (`iserve deploy`, `iserve plan`)."""
    if args.best_available and args.min_accuracy is None:
        usage_error(f"{command}: --best-available goes with --min-accuracy")
    intent = common.Intent(
        kind=kind,
        cost_formula=COST_FORMULAS.get(args.cost, 0) if kind in COSTED else 0,
        latency_slo_ms=(args.slo_ms or 0) if kind == common.INTENT_KIND_LATENCY_SLO else 0,
        cost_budget=(args.budget or 0) if kind == common.INTENT_KIND_COST_SLO else 0,
        allow_best_available_accuracy=args.best_available,
    )
    if args.min_accuracy is not None:
        intent.min_accuracy = args.min_accuracy
    return intent


def objectives(args) -> common.ServiceObjectives:
    """The DeployRequest's scheduling policy and latency objectives (argparse has
    checked the objectives are whole numbers of at least 1 ms)."""
    return common.ServiceObjectives(
        scheduling=SCHEDULING[args.scheduling] if args.scheduling else 0,
        ttft_slo_ms=args.ttft_slo_ms or 0,
        tpot_slo_ms=args.tpot_slo_ms or 0,
    )


def describe_objectives(objectives: common.ServiceObjectives) -> str:
    """``edf ttft<=200ms tpot<=50ms`` (objectives that are set only)."""
    name = common.SchedulingPolicy.Name(objectives.scheduling).removeprefix("SCHEDULING_POLICY_")
    parts = [name.lower() if objectives.scheduling else "fcfs"]
    for label, value in (
        ("ttft", objectives.ttft_slo_ms),
        ("tpot", objectives.tpot_slo_ms),
        ("deadline", objectives.default_deadline_ms),
    ):
        if value:
            parts.append(f"{label}<={value}ms")
    return " ".join(parts)


def describe_config(config: common.DeploymentConfig) -> str:
    parts = [f"tp={config.tensor_parallel}", f"pp={config.pipeline_parallel}"]
    if config.variant_name:
        parts.append(f"variant={config.variant_name}")
    for name, value, table in (
        ("weights", config.weight_quant, WEIGHT_QUANTS),
        ("kv", config.kv_quant, KV_QUANTS),
        ("pruning", config.pruning, PRUNINGS),
    ):
        label = next((k for k, v in table.items() if v == value), "none")
        if label != "none":
            parts.append(f"{name}={label}")
    parts.append(f"batch={config.batch_size or 1}")
    return " ".join(parts)


def replica_count(args) -> int:
    """The request's ``replicas`` from ``--replicas`` (0, the server's 1, when not
    given; argparse has checked it is at least 1); the server refuses a count above its
    maximum."""
    return args.replicas or 0


def print_decision(decision: deploy_pb.DeploymentDecision) -> None:
    """The decision for a person, on stderr: winner, placement of every replica,
    estimate, skipped."""
    out = sys.stderr
    placements = [decision.placement, *decision.replica_placements]
    count = f", {len(placements)} replicas" if len(placements) > 1 else ""
    print(f"chose #{decision.winner_rank}: {describe_config(decision.config)}{count}", file=out)
    for index, placement in enumerate(placements):
        replica = f"replica {index} " if len(placements) > 1 else ""
        for stage in placement.stages:
            devices = ", ".join(f"{d.node_id}/{d.device_id}" for d in stage.devices)
            last = stage.first_layer + stage.layer_count - 1
            mib = max(stage.reserved_bytes, default=0) / 2**20
            print(
                f"  {replica}stage {stage.stage}: layers {stage.first_layer}-{last} on "
                f"{devices} ({mib:.0f} MiB each)",
                file=out,
            )
    e = decision.estimate
    if e.latency_ms:
        print(
            f"  estimate: latency {e.latency_ms:.1f} ms (TTFT {e.ttft_ms:.2f} ms, TPOT "
            f"{e.tpot_ms:.2f} ms), memory {e.memory_total_bytes / 2**30:.2f} GiB in all "
            "(reservations add each worker's runtime)",
            file=out,
        )
    for s in decision.skipped:
        print(f"  skipped #{s.rank} {describe_config(s.config)}: {s.reason}", file=out)
    if decision.note:
        print(f"  note: {decision.note}", file=out)


def deploy_progress(
    stub, model_id: str, request_id: str, *, rpc_timeout_s: float = 2.0
) -> Callable[[float], str]:
    """What ``iserve deploy`` shows while its Deploy runs: planning until the deployer
    records the deployment of ``request_id``, then its configuration and devices while
    the workers start and load the weights, with the time since the request."""

    def describe(elapsed_s: float) -> str:
        doing = f"deploying {model_id}: planning"
        if elapsed_s > 0:
            try:
                listed = stub.ListDeployments(
                    deploy_pb.ListDeploymentsRequest(
                        request_id=uuid.uuid4().hex[:16], model_id=model_id
                    ),
                    timeout=rpc_timeout_s,
                ).deployments
            except grpc.RpcError:
                listed = []  # the Deploy's own answer says what went wrong, if anything
            mine = next((d for d in listed if d.request_id == request_id), None)
            if mine is not None:
                doing = f"deploying {mine.deployment_id}: {starting_text(mine)}"
        return f"{doing} ({elapsed_s:.0f} s; Ctrl-C cancels and rolls back)"

    return describe


def starting_text(deployment: deploy_pb.Deployment) -> str:
    """A deployment being started, in a few words: its configuration and devices."""
    devices = [
        f"{d.node_id}/{d.device_id}"
        for placement in (r.placement for r in deployment.replicas)
        for stage in placement.stages
        for d in stage.devices
    ] or [
        f"{d.node_id}/{d.device_id}" for stage in deployment.placement.stages for d in stage.devices
    ]
    shown = ", ".join(devices[:4]) + (f" and {len(devices) - 4} more" if len(devices) > 4 else "")
    state = state_name(deployment.state).lower()
    count = len(deployment.replicas)
    copies = f", {count} replicas" if count > 1 else ""
    return f"{state} {describe_config(deployment.config)}{copies} on {shown or 'its devices'}"


def state_name(state: int) -> str:
    """A DeploymentState as the CLI shows it: ``READY``, ``STARTING``, ``FAILED``…"""
    return deploy_pb.DeploymentState.Name(state).removeprefix("DEPLOYMENT_STATE_")


# A log line quoted in a listing is cut to this many characters.
LISTED_LOG_LINE_CHARS = 160


def listed_reason(reason: str) -> str:
    """A state reason on one line for the CLI's listings: its first line, and of the log
    lines a worker's failure carries after it, the last, which names the cause ("the
    short reason hides it", a tester: "exited with code 1 before it was ready (log lines
    in the full reason)", the tensor of the wrong shape in --json only). Clients of the
    gateway and the scheduler get the first line alone (``replicas.reason_summary``)."""
    first, _, rest = reason.strip().partition("\n")
    lines = [line.strip() for line in rest.splitlines() if line.strip()]
    if not lines:
        return first
    last = lines[-1]
    if len(last) > LISTED_LOG_LINE_CHARS:
        last = last[: LISTED_LOG_LINE_CHARS - 1] + "…"
    return f"{first.rstrip(':').rstrip()}; its last log line: {last} (all of them in --json)"


def describe_replicas(deployment: deploy_pb.Deployment) -> str:
    """``replica 0 READY 127.0.0.1:40001, replica 1 FAILED 127.0.0.1:40002 (why)``."""
    parts = []
    for replica in replicas.replicas_of(deployment):
        state = state_name(replica.state)
        reason = listed_reason(replica.state_reason)
        why = f" ({reason})" if reason else ""
        parts.append(f"replica {replica.index} {state} {replica.worker_address or '-'}{why}")
    return ", ".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The intent, policy and explicit-configuration flags of ``iserve deploy``."""
    p.add_argument("--intent", choices=sorted(INTENTS), help="what to optimise (default min-cost)")
    p.add_argument(
        "--slo-ms", type=positive_number, help="latency target at --max-output (latency-slo)"
    )
    p.add_argument(
        "--budget", type=positive_number, help="cost budget in the --cost unit (cost-slo)"
    )
    p.add_argument(
        "--cost",
        choices=sorted(COST_FORMULAS),
        help="cost formula for min-cost, cost-slo and latency-slo (the cheapest that meets "
        "the target; default memory-latency: GB x s)",
    )
    p.add_argument("--min-accuracy", type=float, help="accuracy floor over the variants' scores")
    p.add_argument(
        "--best-available",
        action="store_true",
        help="when no variant meets --min-accuracy, take the most accurate instead of failing",
    )
    p.add_argument("--policy", choices=sorted(POLICIES), help="device placement (default hybrid)")
    p.add_argument(
        "--scheduling",
        choices=sorted(SCHEDULING),
        help="queue policy (default fcfs; edf for --intent latency-slo)",
    )
    p.add_argument("--ttft-slo-ms", type=whole_number(), help="time-to-first-token objective (ms)")
    p.add_argument(
        "--tpot-slo-ms", type=whole_number(), help="time-per-output-token objective (ms)"
    )
    p.add_argument("--plan", action="store_true", help="show the decision; launch nothing")
    p.add_argument(
        "--replicas",
        type=whole_number(maximum=replicas.MAX_REPLICAS),
        help="independent copies of the configuration behind one deployment id, each on "
        "devices of its own; requests go to the one with the shortest expected wait "
        f"(default 1, at most {replicas.MAX_REPLICAS})",
    )
    p.add_argument("--tp", type=whole_number(), help="explicit: tensor-parallel degree")
    p.add_argument("--pp", type=whole_number(), help="explicit: pipeline-parallel degree")
    p.add_argument("--variant", help="explicit: a registered compression variant by name")
    p.add_argument(
        "--dtype",
        choices=sorted(PRECISIONS),
        help="explicit; default: the checkpoint's on GPUs, float32 on CPUs, as profiled "
        "(float16 on GPUs only)",
    )
    p.add_argument("--weight-quant", choices=sorted(WEIGHT_QUANTS), help="explicit")
    p.add_argument("--kv-quant", choices=sorted(KV_QUANTS), help="explicit")
    p.add_argument("--pruning", choices=sorted(PRUNINGS), help="explicit")
